"""Degradation profiles: a ``normal`` and a ``protect`` configuration, the triggers that switch to protect,
and the recovery rule that switches back.

The file is YAML (``pagedserve tune`` writes one; ``pagedserve serve --profiles FILE`` reads it):

    profiles:
      normal:  {max_num_seqs: 16, max_num_batched_tokens: 4096, max_num_queued_reqs: 48}
      protect: {max_num_seqs: 8, max_num_batched_tokens: 2048, max_input_tokens: 2048, max_num_queued_reqs: 16,
                max_priority: 0, restart: {kv_cache_dtype: fp8}}   # max_priority: sheds priority >= 1
    triggers:            # to protect when any signal stays above its level for for_s seconds
      kv_cache_usage: {above: 0.9, for_s: 10}
      preemptions_per_min: {above: 0}
      itl_p95_ms: {above: 50, for_s: 10}
    recovery: {min_dwell_s: 120, hold_s: 60}   # back to normal when what switched is at or below its
                                               # clear level (and nothing else above its level) for
                                               # hold_s, after at least min_dwell_s

A profile's scheduler limits change between two steps; its ingress limits apply to the next request;
``restart`` lists settings that need a restart and are never applied live (the runbook's manual steps).
``ProfileController`` is the switching rule alone, fed with samples, so it is tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, StrictInt, ValidationError

from pagedserve.errors import ConfigError

PROFILES = ("normal", "protect")
SIGNAL_HELP = {
    "kv_cache_usage": "KV-cache usage, 0..1 (vllm:kv_cache_usage_perc)",
    "preemptions_per_min": "preemptions over the last minute (vllm:num_preemptions_total)",
    "ttft_p95_ms": "p95 time to first token over the window, ms",
    "itl_p95_ms": "p95 inter-token latency over the window, ms",
    "queue_depth": "requests waiting for a slot (vllm:num_requests_waiting)",
    "long_prompts_per_min": "prompts longer than long_prompt_tokens arriving (admitted or not) over the last minute",
}
RESTART_SETTINGS = ("kv_cache_dtype", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
                    "max_num_batched_tokens", "enable_chunked_prefill")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Profile(_Strict):
    """What a profile sets: the scheduler limits that change live, and the limits at the entrance."""

    max_num_seqs: PositiveInt
    max_num_batched_tokens: PositiveInt
    max_input_tokens: PositiveInt | None = None
    max_num_queued_reqs: PositiveInt | None = None
    max_num_queued_tokens: PositiveInt | None = None
    # with --scheduling-policy priority: requests less urgent than this (a higher priority value) are shed
    max_priority: StrictInt | None = None
    restart: dict[Literal[RESTART_SETTINGS], str | int | float | bool] = Field(default_factory=dict)

    def live_limits(self) -> dict:
        return self.model_dump(exclude={"restart"})


class Trigger(_Strict):
    above: float = Field(ge=0)
    for_s: float = Field(default=0.0, ge=0)
    clear_below: float | None = Field(default=None, ge=0)  # default: 80 % of ``above``

    @property
    def clear_level(self) -> float:
        return self.clear_below if self.clear_below is not None else 0.8 * self.above


class Triggers(_Strict):
    kv_cache_usage: Trigger | None = None
    preemptions_per_min: Trigger | None = None
    ttft_p95_ms: Trigger | None = None
    itl_p95_ms: Trigger | None = None
    queue_depth: Trigger | None = None
    long_prompts_per_min: Trigger | None = None
    long_prompt_tokens: PositiveInt | None = None

    def active(self) -> dict[str, Trigger]:
        return {name: t for name in SIGNAL_HELP if (t := getattr(self, name)) is not None}


class Recovery(_Strict):
    min_dwell_s: float = Field(default=120.0, ge=0)
    hold_s: float = Field(default=60.0, ge=0)


class ProfilesFile(_Strict):
    version: Literal[1] = 1
    model: str | None = None
    generated_by: str | None = None
    window_s: PositiveFloat = 30.0          # latency percentiles are over this many seconds
    rate_window_s: PositiveFloat = 60.0     # per-minute rates are counted over this many seconds
    tick_s: PositiveFloat = 1.0             # how often the server samples its signals
    profiles: dict[Literal[PROFILES], Profile]
    triggers: Triggers = Field(default_factory=Triggers)
    recovery: Recovery = Field(default_factory=Recovery)

    def model_post_init(self, _) -> None:
        missing = [p for p in PROFILES if p not in self.profiles]
        if missing:
            raise ValueError(f"profiles needs both normal and protect (missing: {', '.join(missing)})")
        if self.triggers.long_prompts_per_min is not None and self.triggers.long_prompt_tokens is None:
            raise ValueError("triggers.long_prompts_per_min needs triggers.long_prompt_tokens (what counts as long)")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "the file"
    got = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err.get("input"), dict) else ""
    hint = (" (a top-level 'profiles:' mapping holds 'normal:' and 'protect:'; `pagedserve tune` writes such a file)"
            if err["type"] == "missing" and tuple(err["loc"]) == ("profiles",) else "")
    return f"{where}: {err['msg']}{got}{hint}"


def load_profiles(path: str | Path) -> ProfilesFile:
    """Read and validate a profiles file; the error names the file and the offending key."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--profiles {str(p)!r} is not a file.")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"--profiles {p}: not valid YAML ({e}).") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--profiles {p}: expected a mapping with 'profiles', 'triggers' and 'recovery'.")
    try:
        return ProfilesFile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"--profiles {p}: {_first_error(e)}.") from e


def dump_profiles(spec: ProfilesFile, header: str = "") -> str:
    import yaml

    data = spec.model_dump(exclude_none=True)
    for prof in data["profiles"].values():
        if not prof["restart"]:
            del prof["restart"]
    body = yaml.safe_dump(data, sort_keys=False)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body


def check_against_engine(spec: ProfilesFile, config) -> None:
    """Every profile's live limits must be ones the running engine accepts (``config.check_runtime_limits``)
    and its input cap must fit the context."""
    for name, prof in spec.profiles.items():
        try:
            config.check_runtime_limits(prof.max_num_seqs, prof.max_num_batched_tokens)
        except ConfigError as e:
            raise ConfigError(f"--profiles: profiles.{name}: {e}") from e
        if prof.max_priority is not None and config.args.scheduling_policy != "priority":
            raise ConfigError(f"--profiles: profiles.{name}.max_priority sheds requests by their priority, which "
                              f"only --scheduling-policy priority takes (under fcfs every request has priority 0): "
                              f"add the flag, or leave max_priority out.")
        if prof.max_input_tokens is not None and prof.max_input_tokens >= config.max_model_len:
            raise ConfigError(f"--profiles: profiles.{name}.max_input_tokens ({prof.max_input_tokens}) must be below "
                              f"max_model_len ({config.max_model_len}), which already caps prompts.")


# --------------------------------------------------------------------------------------------------
# The switching rule
# --------------------------------------------------------------------------------------------------

@dataclass
class Switch:
    at: float                 # time of the sample that decided it
    from_profile: str
    to_profile: str
    reason: str
    values: dict[str, float | None]
    manual: bool = False


@dataclass
class ProfileController:
    """Normal -> protect when any trigger's signal has stayed above its level for its ``for_s``; protect ->
    normal when the signals that caused the switch have stayed at or below their clear level (hysteresis)
    for ``hold_s``, no other signal is above its level, and protect has lasted ``min_dwell_s``, so a signal
    hovering at a level cannot make the server flap. The other signals are held to the trigger level, not
    the clear level: protect's smaller batches raise TTFT and the queue for the same traffic, so under
    protect they would never look as they did under normal, and the server would never come back. A manual
    switch pins the profile until ``pin(None)`` hands control back."""

    spec: ProfilesFile
    active: str = "normal"
    pinned: bool = False
    since: float = 0.0                                # when the active profile started
    last_switch: Switch | None = None
    _above_since: dict[str, float] = field(default_factory=dict)
    _clear_since: float | None = None
    _causes: frozenset[str] = frozenset()             # the signals that switched to protect

    def pin(self, profile: str | None, now: float) -> Switch | None:
        """Switch by hand and hold it (``None``: back to automatic switching)."""
        if profile is None:
            self.pinned = False
            self._above_since.clear()
            self._clear_since = None
            return None
        self.pinned = True
        return self._switch(profile, now, "switched by hand (POST /admin/profile)", {}, manual=True)

    def update(self, now: float, values: dict[str, float | None]) -> Switch | None:
        """Feed one sample of the signals (None: no data, e.g. no requests in the window)."""
        triggers = self.spec.triggers.active()
        for name, trig in triggers.items():
            v = values.get(name)
            if v is not None and v > trig.above:
                self._above_since.setdefault(name, now)
            else:
                self._above_since.pop(name, None)
        clear = all(values.get(n) is None or values[n] <= (t.clear_level if n in self._causes else t.above)
                    for n, t in triggers.items())
        if not clear:
            self._clear_since = None
        elif self._clear_since is None:
            self._clear_since = now
        if self.pinned:
            return None
        if self.active == "normal":
            fired = [n for n, t0 in self._above_since.items() if now - t0 >= triggers[n].for_s]
            if fired:
                reason = "; ".join(f"{n} {values[n]:.3g} > {triggers[n].above:g}"
                                   + (f" for {triggers[n].for_s:g} s" if triggers[n].for_s else "") for n in fired)
                return self._switch("protect", now, reason, values, causes=frozenset(fired))
        elif self.active == "protect":
            rec = self.spec.recovery
            if (self._clear_since is not None and now - self._clear_since >= rec.hold_s
                    and now - self.since >= rec.min_dwell_s):
                causes = ", ".join(sorted(self._causes)) or "no cause (switched by hand)"
                return self._switch("normal", now, f"{causes} at or below the clear level and no trigger above its "
                                                   f"level for {rec.hold_s:g} s, after {now - self.since:.0f} s in "
                                                   f"protect", values)
        return None

    def earliest_recovery(self, now: float) -> float:
        """Seconds until protect could end at the soonest (for Retry-After)."""
        rec = self.spec.recovery
        held = 0.0 if self._clear_since is None else now - self._clear_since
        return max(rec.min_dwell_s - (now - self.since), rec.hold_s - held, 1.0)

    def _switch(self, to: str, now: float, reason: str, values: dict, manual: bool = False,
                causes: frozenset[str] = frozenset()) -> Switch | None:
        if to not in self.spec.profiles:
            raise ConfigError(f"profile {to!r}: choose one of {', '.join(self.spec.profiles)} (or auto).")
        if to == self.active:
            return None
        sw = Switch(now, self.active, to, reason, {k: v for k, v in values.items() if v is not None}, manual)
        self.active, self.since, self.last_switch, self._causes = to, now, sw, causes
        self._above_since.clear()
        self._clear_since = None
        return sw

