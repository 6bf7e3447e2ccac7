"""Where a load ladder stops paying: the knee, and the setting to recommend left of it.

A rung is one load level's result under vLLM bench's field names (``output_throughput``,
``p95_ttft_ms``, ``server_preemptions`` ...). Each signal below can mark a rung; the knee is the first
rung any enabled signal marks, and the recommendation is the highest rung left of it that meets every SLO
and failed no request:

- ``throughput``: output throughput gained less than ``min_gain`` per doubling of the load from the rung
  before, and no higher rung gains more than that over the rung before either (more load buys little; a
  flat step the next rungs climb out of is noise, not a knee);
- ``latency``: p95 E2EL or ITL (``latency_metrics``) above ``latency_factor`` times the lowest rung's: request
  latency climbs. TTFT is not among the defaults: in a closed loop it grows with every prompt that shares
  a prefill step long before throughput stops growing, so a TTFT limit is the user's to give (``--slo
  ttft_p95=MS``). For a metric the user gave an SLO for, the SLO decides instead;
- ``preemption``: the server preempted requests (the KV cache ran out);
- ``kv_cache``: peak KV-cache usage reached ``kv_usage`` (preemption is one burst away);
- ``failures``: more than ``max_failure_rate`` of the requests failed;
- ``slo``: a user SLO (``--slo ttft_p95=500``) is broken;
- ``kneedle``: the point of greatest curvature of throughput over log2(load) (Satopaa et al., 2011). Off by
  default: with six to nine rungs it finds a bend even in a straight line's noise, so it is reported, not
  trusted alone;
- ``host``: the engine waited on the GPU for less than ``HOST_BOUND`` of the rung's time, so the GPU idled
  between steps: the server's host work (Python scheduling, streaming) bounds it. Off by default: it
  names a cause rather than a knee, and the knee's reason carries it when it fires there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from pagedserve.errors import ConfigError
from pagedserve.bench.metrics import KV_FULL

SIGNALS = ("throughput", "latency", "preemption", "kv_cache", "failures", "slo", "kneedle", "host")
DEFAULT_SIGNALS = SIGNALS[:-2]
HOST_BOUND = 0.10  # below this share of a rung's time waiting on the GPU, the host bounds the steps
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_STATS = {"mean": "mean", "p50": "p50", "median": "p50", "p95": "p95", "p99": "p99"}
LATENCY_METRICS = ("itl", "e2el")


def tightest_slo(slo: dict[str, float], metric: str) -> float | None:
    """The tightest limit (ms) ``slo`` gives ``metric`` over its statistics (``ttft_p95``, ``ttft_p99`` ...)."""
    values = [v for k, v in slo.items() if k.startswith(metric + "_")]
    return min(values) if values else None


def parse_slo(items: list[str] | None) -> dict[str, float]:
    """``["ttft_p95=500", "itl_p95=50"]`` (milliseconds) -> {"ttft_p95": 500.0, "itl_p95": 50.0}."""
    slo = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        metric, _, stat = key.partition("_")
        if not sep or metric not in SLO_METRICS or stat not in SLO_STATS:
            raise ConfigError(f"--slo {item!r}: use METRIC_STAT=MS with METRIC one of {', '.join(SLO_METRICS)} "
                              f"and STAT one of {', '.join(SLO_STATS)}, e.g. ttft_p95=500 itl_p95=50.")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(f"--slo {item!r}: {value!r} is not a number of milliseconds.") from None
        if not ms > 0:
            raise ConfigError(f"--slo {item!r}: the limit must be a positive number of milliseconds.")
        slo[f"{metric}_{SLO_STATS[stat]}"] = ms
    return slo


def slo_field(key: str) -> str:
    """``ttft_p95`` -> ``p95_ttft_ms`` (the rung's field, vLLM's name)."""
    metric, stat = key.split("_")
    return f"{stat}_{metric}_ms"


def slo_violations(rung: dict, slo: dict[str, float]) -> list[str]:
    out = []
    for key, limit in slo.items():
        value = rung.get(slo_field(key))
        if value is not None and value > limit:
            out.append(f"{key} {value:.1f} ms > {limit:g} ms")
    return out


@dataclass
class KneeSettings:
    min_gain: float = 0.10
    latency_factor: float = 3.0
    kv_usage: float = KV_FULL
    max_failure_rate: float = 0.0
    slo: dict[str, float] = field(default_factory=dict)
    signals: tuple[str, ...] = DEFAULT_SIGNALS
    latency_metrics: tuple[str, ...] = LATENCY_METRICS

    def __post_init__(self) -> None:
        unknown = set(self.signals) - set(SIGNALS)
        if unknown:
            raise ConfigError(f"--knee-signals: unknown {sorted(unknown)}; choose from {', '.join(SIGNALS)}.")
        unknown = set(self.latency_metrics) - set(SLO_METRICS)
        if unknown:
            raise ConfigError(f"--knee-latency-metrics: unknown {sorted(unknown)}; choose from {', '.join(SLO_METRICS)}.")
        if (not self.min_gain >= 0 or not self.latency_factor > 1 or not 0 < self.kv_usage <= 1
                or not 0 <= self.max_failure_rate < 1):  # written so that nan fails each
            raise ConfigError("--knee-min-gain must be >= 0, --knee-latency-factor > 1, --knee-kv-usage in (0, 1] "
                              "and --knee-max-failure-rate in [0, 1).")


@dataclass
class Signal:
    name: str
    rung: int          # index into the ladder
    load: float
    message: str
    enabled: bool = True


@dataclass
class KneeResult:
    knee: int | None                  # index of the knee rung, None if no enabled signal fired
    knee_load: float | None
    signals: list[Signal]             # every signal that fired, at any rung, in ladder order
    recommendation: int | None        # index of the recommended rung
    recommended_load: float | None
    reason: str                       # why the knee is there (or why there is none)
    recommendation_reason: str
    kneedle: int | None
    next_loads: list[float] | None    # a ladder to try next when no knee appeared

    def to_json(self) -> dict:
        return asdict(self)


# each kind of ladder: the flag that lists its loads, and what a load is called
LADDERS = {"concurrency": ("--concurrency", "concurrency"), "rate": ("--request-rates", "request rate"),
           "replay": ("--replay-speeds", "replay speed")}
LADDER_FLAGS = {unit: flag for flag, unit in LADDERS.values()}


def _fmt_load(load: float, unit: str) -> str:
    return f"{unit} {load:g}"


def gain_per_doubling(prev_thr: float, thr: float, prev_load: float, load: float) -> float | None:
    """Throughput growth scaled to one doubling of the load (the ladder need not double)."""
    if prev_thr <= 0 or load <= prev_load:
        return None
    return (thr / prev_thr) ** (1.0 / math.log2(load / prev_load)) - 1.0


def kneedle(loads: list[float], values: list[float], min_bend: float = 0.1) -> int | None:
    """Index of the greatest bend of a rising, flattening curve over log2(load): both axes scaled to
    [0, 1], the knee is where the curve stands highest above the chord; None if it never stands more
    than ``min_bend`` above it (a straight line, or too few points)."""
    if len(loads) < 3 or max(values) <= min(values):
        return None
    xs = [math.log2(x) for x in loads]
    x0, x1, y0, y1 = xs[0], xs[-1], min(values), max(values)
    diff = [(y - y0) / (y1 - y0) - (x - x0) / (x1 - x0) for x, y in zip(xs, values)]
    best = max(range(len(diff)), key=diff.__getitem__)
    return best if diff[best] > min_bend else None


def find_knee(rungs: list[dict], loads: list[float], settings: KneeSettings, unit: str = "concurrency") -> KneeResult:
    """Mark each rung with the signals it fires, then place the knee and the recommendation."""
    if not rungs:
        raise ValueError("no rungs")
    signals: list[Signal] = []
    enabled = set(settings.signals)

    def fire(name: str, i: int, message: str) -> None:
        signals.append(Signal(name, i, loads[i], message, name in enabled))

    base = rungs[0]
    for i, r in enumerate(rungs):
        at = _fmt_load(loads[i], unit)
        total = r.get("completed", 0) + r.get("failed", 0)
        if total and r.get("failed", 0) / total > settings.max_failure_rate:
            fire("failures", i, f"{r['failed']} of {total} requests failed at {at}")
        broken = slo_violations(r, settings.slo)
        if broken:
            fire("slo", i, f"SLO broken at {at}: {'; '.join(broken)}")
        pre = r.get("server_preemptions")
        if pre:
            fire("preemption", i, f"{pre:.0f} preemptions at {at}: the KV cache ran out of blocks")
        kv = r.get("server_peak_kv_cache_usage")
        if kv is not None and kv >= settings.kv_usage:
            fire("kv_cache", i, f"peak KV-cache usage {100 * kv:.1f} % at {at} (limit {100 * settings.kv_usage:.0f} %)")
        wait = r.get("server_device_wait_share")
        if wait is not None and wait < HOST_BOUND:
            fire("host", i, f"the engine waited on the GPU {100 * wait:.0f} % of the time at {at}: the host "
                            f"(scheduling, streaming), not the GPU, bounds the steps; serve --stream-interval 4 "
                            f"writes a quarter of the frames")
        if i == 0:
            continue
        prev = rungs[i - 1]
        base_thr = prev.get("output_throughput", 0.0)
        gains = [gain_per_doubling(base_thr, later.get("output_throughput", 0.0), loads[i - 1], loads[j])
                 for j, later in enumerate(rungs[i:], i)]  # to this rung and to each above it
        g = gains[0]
        if all(x is not None and x < settings.min_gain for x in gains):
            fire("throughput", i,
                 f"output throughput {prev['output_throughput']:,.0f} -> {r['output_throughput']:,.0f} tok/s from "
                 f"{_fmt_load(loads[i - 1], unit)} to {loads[i]:g}: {100 * g:+.1f} % per doubling "
                 f"(below {100 * settings.min_gain:.0f} %)")
        for metric in settings.latency_metrics:
            if any(k.startswith(metric + "_") for k in settings.slo):
                continue  # the user's SLO says what latency is acceptable for this metric
            key = f"p95_{metric}_ms"
            b, v = base.get(key), r.get(key)
            if b and v and v > settings.latency_factor * b:
                fire("latency", i, f"p95 {metric.upper()} {v:,.1f} ms at {at} is {v / b:.1f}x the {b:,.1f} ms at "
                                   f"{_fmt_load(loads[0], unit)} (limit {settings.latency_factor:g}x)")

    curve = [r.get("output_throughput", 0.0) for r in rungs]
    bend = kneedle(loads, curve)
    if bend is not None:
        fire("kneedle", bend, f"throughput over log2({unit}) bends most at {_fmt_load(loads[bend], unit)}")
    signals.sort(key=lambda s: (s.rung, SIGNALS.index(s.name)))

    knee = next((s.rung for s in signals if s.enabled), None)
    if knee is None:
        last_gain = None
        if len(rungs) > 1:
            last_gain = gain_per_doubling(rungs[-2].get("output_throughput", 0.0), curve[-1], loads[-2], loads[-1])
        grew = f"throughput still grew {100 * last_gain:.0f} % per doubling at the last step and " if last_gain else ""
        top = loads[-1]
        next_loads = [top * 2 ** k for k in range(4)]
        reason = (f"No knee up to {_fmt_load(top, unit)}: {grew}no latency, memory, failure or SLO signal fired. "
                  f"Extend the ladder: {LADDER_FLAGS[unit]} "
                  f"{','.join(f'{x:g}' for x in next_loads)}")
    else:
        next_loads = None
        reason = f"Knee at {_fmt_load(loads[knee], unit)}: " + "; ".join(
            s.message for s in signals if s.rung == knee and s.enabled)
        cause = next((s.message for s in signals if s.rung == knee and s.name == "host" and not s.enabled), None)
        if cause is not None:
            reason += f" ({cause})"

    limit = len(rungs) if knee is None else knee
    ok = [i for i in range(limit) if not slo_violations(rungs[i], settings.slo) and not rungs[i].get("failed")]
    rec = ok[-1] if ok else None
    if rec is None:
        first = "the knee is the lowest rung" if knee == 0 else "no rung left of the knee meets every SLO with no failures"
        rec_reason = (f"Nothing to recommend: {first}. Start the ladder lower, relax the SLO, shorten the prompts, or "
                      f"give the model more hardware.")
    else:
        r = rungs[rec]
        where = "the highest rung" if knee is None else "the highest rung left of the knee"
        rec_reason = (f"{_fmt_load(loads[rec], unit)}: {where} that meets every SLO with no failures "
                      f"({r.get('output_throughput', 0):,.0f} output tok/s, p95 TTFT {r.get('p95_ttft_ms', 0):,.1f} ms, "
                      f"p95 ITL {r.get('p95_itl_ms', 0):,.1f} ms, p95 E2EL {r.get('p95_e2el_ms', 0):,.0f} ms)")
    return KneeResult(knee, None if knee is None else loads[knee], signals, rec,
                      None if rec is None else loads[rec], reason, rec_reason, bend, next_loads)
