"""The degradation path at run time: sample the signals the triggers read, let ``ProfileController``
decide, and apply a switch: the scheduler's limits between two steps, the entrance's limits for the next
request. Requests already accepted are never dropped: a lowered ``max_num_seqs`` admits nobody new until
enough running requests finish."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict

import numpy as np

from pagedserve.tune.profiles import SIGNAL_HELP, ProfileController, ProfilesFile, Switch

logger = logging.getLogger(__name__)

_MINUTE = 60.0


class SignalWindow:
    """Recent latencies, prompt lengths and preemptions, kept for as long as the triggers look back:
    latencies over ``window_s``, per-minute rates counted over ``rate_window_s``."""

    def __init__(self, window_s: float, rate_window_s: float, long_prompt_tokens: int | None):
        self.window_s, self.rate_window_s, self.long_prompt_tokens = window_s, rate_window_s, long_prompt_tokens
        self._ttft: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        self._long: deque[float] = deque()
        self._preemptions: deque[tuple[float, int]] = deque()
        self.long_prompts_total = 0

    def ttft(self, t: float, seconds: float) -> None:
        self._ttft.append((t, seconds))

    def itl(self, t: float, seconds: float) -> None:
        self._itl.append((t, seconds))

    def arrived(self, prompt_lens: list[int]) -> None:
        """Count long prompts as they arrive, admitted or not: while protect sheds a burst the burst still
        counts, so the server does not return to normal in the middle of it."""
        if self.long_prompt_tokens is not None:
            now = time.monotonic()
            long = [now for n in prompt_lens if n > self.long_prompt_tokens]
            self._long.extend(long)
            self.long_prompts_total += len(long)

    @staticmethod
    def _trim(q: deque, since: float) -> None:
        while q and (q[0][0] if isinstance(q[0], tuple) else q[0]) < since:
            q.popleft()

    def sample(self, now: float, core) -> dict[str, float | None]:
        """Every signal's value now (None: no data in the window, which never fires or blocks recovery)."""
        self._preemptions.append((now, core.counters.num_preemptions))
        for q, span in ((self._ttft, self.window_s), (self._itl, self.window_s), (self._long, self.rate_window_s),
                        (self._preemptions, self.rate_window_s)):
            self._trim(q, now - span)
        per_min = _MINUTE / self.rate_window_s

        def p95(q: deque) -> float | None:
            return 1000.0 * float(np.percentile([v for _, v in q], 95)) if q else None

        stats = core.last_stats
        return {
            "kv_cache_usage": stats.kv_cache_usage,
            "preemptions_per_min": per_min * (self._preemptions[-1][1] - self._preemptions[0][1]),
            "ttft_p95_ms": p95(self._ttft),
            "itl_p95_ms": p95(self._itl),
            "queue_depth": float(stats.num_waiting),
            "long_prompts_per_min": per_min * len(self._long) if self.long_prompt_tokens is not None else None,
        }


class Degradation:
    def __init__(self, spec: ProfilesFile, state):
        self.spec, self.state = spec, state
        self.controller = ProfileController(spec, since=time.monotonic())
        self.window = SignalWindow(spec.window_s, spec.rate_window_s, spec.triggers.long_prompt_tokens)
        self.switches: dict[str, int] = {}
        self.values: dict[str, float | None] = {}
        state.metrics.degradation, state.metrics.window = self, self.window
        state.admission.retry_after = lambda: self.controller.earliest_recovery(time.monotonic())
        state.admission.apply("normal", spec.profiles["normal"].live_limits())
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Put the normal profile's scheduler limits in force (the engine may have started with larger ones)."""
        await self._apply_limits("normal")
        logger.info("Degradation profiles: normal %s; protect %s", self.spec.profiles["normal"].live_limits(),
                    self.spec.profiles["protect"].live_limits())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.spec.tick_s)
            now = time.monotonic()
            self.values = self.window.sample(now, self.state.engine.core)
            async with self._lock:
                sw = self.controller.update(now, self.values)
                if sw is not None:
                    await self._switched(sw)

    async def set_manual(self, profile: str | None) -> None:
        """Pin ``profile`` (None: automatic switching again)."""
        async with self._lock:
            sw = self.controller.pin(profile, time.monotonic())
            if sw is not None:
                await self._switched(sw)
            elif profile is None:
                logger.info("Degradation profiles: automatic switching again (active: %s)", self.controller.active)

    async def _apply_limits(self, name: str) -> None:
        """The entrance's limits at once (in the same loop turn as the decision, so no reader sees the new
        profile with the old limits); the scheduler's between its next two steps."""
        prof = self.spec.profiles[name]
        self.state.admission.apply(name, prof.live_limits())
        await self.state.engine.set_limits(prof.max_num_seqs, prof.max_num_batched_tokens)

    async def _switched(self, sw: Switch) -> None:
        await self._apply_limits(sw.to_profile)
        self.switches[sw.to_profile] = self.switches.get(sw.to_profile, 0) + 1
        prof = self.spec.profiles[sw.to_profile]
        logger.warning("Switched to the %s profile (%s): %s. Now %s", sw.to_profile,
                       "by hand" if sw.manual else "automatically", sw.reason, prof.live_limits())
        if prof.restart:
            logger.warning("The %s profile also lists settings that need a restart, not applied live: %s "
                           "(see the runbook)", sw.to_profile, prof.restart)

    def status(self) -> dict:
        """What GET /admin/profile answers."""
        c = self.controller
        now_mono, now_wall = time.monotonic(), time.time()

        def wall(t: float) -> float:
            return now_wall - (now_mono - t)

        last = None
        if c.last_switch is not None:
            last = {**asdict(c.last_switch), "at": wall(c.last_switch.at)}
            last["from"], last["to"] = last.pop("from_profile"), last.pop("to_profile")
        prof = self.spec.profiles[c.active]
        return {"active": c.active, "mode": "pinned" if c.pinned else "auto", "since": wall(c.since),
                "limits": self.state.admission.limits | {"max_num_seqs": prof.max_num_seqs,
                                                          "max_num_batched_tokens": prof.max_num_batched_tokens},
                "restart_settings": prof.restart, "last_switch": last,
                "signals": {k: self.values.get(k) for k in SIGNAL_HELP},
                "triggers": {k: t.model_dump() for k, t in self.spec.triggers.active().items()},
                "recovery": self.spec.recovery.model_dump(),
                "profiles": {k: p.model_dump() for k, p in self.spec.profiles.items()}}
