"""Online benchmark metrics with vLLM bench serve's definitions, so numbers compare across tools.

TTFT: first streamed chunk that carries a choice, from the request's send time. ITL: every later
chunk's gap to the previous one, pooled over requests. TPOT: per request (E2EL - TTFT) / (tokens - 1),
excluding the first token. E2EL: last token chunk, from send time. Throughputs divide by the wall time
of the whole run. Goodput counts requests that meet every given SLO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0     # seconds since the benchmark started
    generated_text: str = ""


METRIC_KEYS = ("ttft", "tpot", "itl", "e2el")
KV_FULL = 0.90  # KV-cache usage at which preemption is one burst away (gateways use 0.8-0.9)


def scrape(text: str, names: dict[str, str],
           histogram: str | None = None) -> tuple[dict[str, float], dict[float, float]]:
    """Prometheus text, parsed once -> ({our key: value summed over label sets} for the sample names in
    ``names``, ``histogram``'s cumulative bucket counts {upper bound: count} summed over label sets). Several
    names may map to one key (vLLM renamed some metrics across versions); the buckets are empty when the
    server has no such histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    bucket_name = None if histogram is None else histogram + "_bucket"
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if key is not None:
                values[key] = values.get(key, 0.0) + s.value
            elif s.name == bucket_name:
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return values, buckets


def info_labels(text: str, name: str) -> dict[str, str]:
    """The labels of info metric ``name`` (a gauge of 1 whose labels carry the facts) in Prometheus text; empty
    when the server has none."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return dict(s.labels)
    return {}


def histogram_quantile(first: dict[float, float], last: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of what a histogram counted between two scrapes, interpolated within its bucket
    as Prometheus does (the last finite bound where it falls past them); None when nothing was counted."""
    bounds = sorted(last)
    counts = [last[b] - first.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = bound, cumulative
    return lower


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` (milliseconds) -> {"ttft": 0.2, "tpot": 0.05}."""
    slos = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: use KEY:MS with KEY one of ttft, tpot, e2el.")
        try:
            slos[key] = float(value) / 1000.0
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds.") from None
    return slos


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      percentile_metrics: list[str], goodput: dict[str, float] | None = None) -> dict:
    """The result dict, keyed as vLLM's JSON (mean_/median_/std_/p{P}_{metric}_ms)."""
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (_tpot(r) for r in ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": _peak_output_rate(ok),
        "max_concurrent_requests": _peak_concurrency(ok),
    }
    if goodput:
        good = 0
        for r in ok:
            tpot = _tpot(r) or 0.0
            if (r.ttft <= goodput.get("ttft", float("inf")) and tpot <= goodput.get("tpot", float("inf"))
                    and r.latency <= goodput.get("e2el", float("inf"))):
                good += 1
        out["request_goodput"] = good / duration
    for key in METRIC_KEYS:
        v = np.asarray(values[key], dtype=float) * 1000.0
        out[f"mean_{key}_ms"] = float(v.mean()) if v.size else 0.0
        out[f"median_{key}_ms"] = float(np.median(v)) if v.size else 0.0
        out[f"std_{key}_ms"] = float(v.std()) if v.size else 0.0
        if key in percentile_metrics:
            for p in percentiles:
                out[f"p{_pct_name(p)}_{key}_ms"] = float(np.percentile(v, p)) if v.size else 0.0
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _peak_output_rate(ok: list[RequestResult]) -> float:
    """Token times rebuilt as start + ttft + cumsum(itl), counted in 1 s bins; the fullest bin."""
    times = []
    for r in ok:
        t = r.start_time + r.ttft
        times.append(t)
        for gap in r.itl:
            t += gap
            times.append(t)
    if not times:
        return 0.0
    counts = np.bincount(np.floor(np.asarray(times)).astype(int))
    return float(counts.max())


def _peak_concurrency(ok: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok],
                    key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak
