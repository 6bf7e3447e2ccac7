"""``pagedserve bench sweep``: the staged load test. Raise the load rung by rung (concurrency 1, 2, 4, 8 ...
or a list of request rates), measure each rung with ``bench serve``'s load generator and metrics, find the
knee and recommend the highest rung left of it (``pagedserve.bench.knee``).

Each rung: reset the server's prefix cache (so one rung's prompts cannot speed up the next), warm up with
one round of requests at the rung's load, then measure ``prompts_per_rung`` fresh prompts (``repeats``
times). The server's own peaks (running, waiting, KV usage, device memory) and preemptions are read from
its /metrics over exactly that window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

import pagedserve
from pagedserve.bench.datasets import LENGTH_DATASETS, SampleRequest, require_recording
from pagedserve.bench.knee import LADDERS, KneeSettings, find_knee, parse_slo, tightest_slo
from pagedserve.bench.metrics import METRIC_KEYS
from pagedserve.bench.serve import BenchConfig, request_sampling, run_benchmark
from pagedserve.errors import BenchmarkError, ConfigError

PERCENTILES = [50.0, 95.0, 99.0]
_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "errors")
_SUMMED = ("completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens", "server_preemptions",
           "server_metrics_scrapes", "server_metrics_scrape_failures")
_MAXED = ("max_input_len",)


REPLAY_WARMUP = 8  # requests of the recording replayed, unmeasured, before each replay rung


@dataclass
class SweepPlan:
    # "concurrency" (closed loop at C in flight), "rate" (open loop), or "replay" (a recording's arrivals,
    # sped up by the load: where the server breaks, in multiples of the recorded traffic)
    mode: str
    loads: list[float]
    prompts_per_rung: int | None = None
    warmup: bool = True
    repeats: int = 1
    reset_prefix_cache: bool = True
    knee: KneeSettings = field(default_factory=KneeSettings)

    def __post_init__(self) -> None:
        flag = LADDERS[self.mode][0]
        if not self.loads or any(not x > 0 or math.isinf(x) for x in self.loads):
            raise ConfigError(f"{flag}: give positive finite values, e.g. 1,2,4,8,16,32.")
        if self.mode == "concurrency" and any(x != int(x) for x in self.loads):
            raise ConfigError(f"{flag}: concurrency levels are whole numbers of requests in flight.")
        if sorted(set(self.loads)) != self.loads:
            raise ConfigError(f"{flag}: list the levels once each, lowest first (the knee is read left to right).")
        if self.prompts_per_rung is not None and self.prompts_per_rung < 1:
            raise ConfigError("--prompts-per-rung must be at least 1.")
        if self.repeats < 1:
            raise ConfigError("--repeats must be at least 1.")

    @property
    def unit(self) -> str:
        return LADDERS[self.mode][1]

    def prompts(self, load: float) -> int | None:
        """Measured prompts of a rung: four rounds of C in flight, ten seconds of arrivals, or (None) the
        whole recording replayed."""
        if self.prompts_per_rung is not None or self.mode == "replay":
            return self.prompts_per_rung
        return max(16, 4 * int(load)) if self.mode == "concurrency" else max(16, math.ceil(10 * load))

    def warmup_prompts(self, load: float) -> int:
        """One round at the rung's load: every slot of the closed loop once, a second of arrivals, or the
        recording's first few requests at the rung's speed."""
        return {"concurrency": int(load), "rate": min(16, math.ceil(load)), "replay": REPLAY_WARMUP}[self.mode]


@dataclass
class Target:
    """Where the load goes and how requests look (``bench serve``'s client settings)."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = True
    burstiness: float = 1.0
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)
    show_progress: bool = False
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})  # and --extra-body: in every request


def aggregate(repeats: list[dict]) -> dict:
    """One rung from its repeats: counts summed, peaks maximal, everything else the median."""
    if len(repeats) == 1:
        return dict(repeats[0])
    out = {}
    for key, first in repeats[0].items():
        values = [r.get(key) for r in repeats]
        if isinstance(first, bool) or not isinstance(first, (int, float)) or any(v is None for v in values):
            out[key] = first
        elif key in _SUMMED:
            out[key] = sum(values)
        elif key.startswith("server_peak_") or key in _MAXED:
            out[key] = max(values)
        else:
            out[key] = statistics.median(values)
    return out


def _rung_record(result: dict) -> dict:
    """A ``run_benchmark`` result without its per-request arrays, with its errors counted by message."""
    record = {k: v for k, v in result.items() if k not in _PER_REQUEST}
    errors = Counter(e for e in result["errors"] if e)
    record["error_counts"] = dict(errors.most_common(5))
    record["max_input_len"] = max(result["input_lens"], default=0)
    return record


async def _reset_prefix_cache(target: Target) -> str:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=headers) as s:
            async with s.post(target.base_url + "/reset_prefix_cache") as resp:
                return {200: "reset", 404: "unsupported", 405: "unsupported"}.get(resp.status, f"HTTP {resp.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"{type(e).__name__}"


def rung_seeds(seed: int, index: int) -> tuple[int, int]:
    """(arrivals, prompts) seeds of rung ``index``: each rung draws its own prompts (repeat r adds r)."""
    return seed + index, seed + 1000 * (index + 1)


async def run_rung(target: Target, plan: SweepPlan, index: int, load: float,
                   samples_for: Callable[[int, int], list[SampleRequest]],
                   replay_for: Callable[[int | None, float], tuple[list[SampleRequest], list[float]]] | None = None
                   ) -> dict:
    """Measure one load level (``samples_for(n, seed)`` draws the rung's prompts; a replay ladder's
    ``replay_for(n, speed)`` gives a recording's first n requests and when to send them)."""
    closed, replay = plan.mode == "concurrency", plan.mode == "replay"
    arrivals, seed = rung_seeds(target.seed, index)

    def workload(n: int | None, prompt_seed: int) -> tuple[BenchConfig, list[SampleRequest]]:
        sends = None
        if replay:
            samples, sends = replay_for(n, load)
        else:
            samples = samples_for(n, prompt_seed)
        return BenchConfig(base_url=target.base_url, endpoint=target.endpoint, model=target.model,
                           request_rate=load if plan.mode == "rate" else math.inf, burstiness=target.burstiness,
                           max_concurrency=int(load) if closed else None, arrivals=sends,
                           replay_speed=load if replay else None, ignore_eos=target.ignore_eos,
                           sampling=target.sampling, seed=arrivals,
                           num_warmups=0, api_key=target.api_key, show_progress=False), samples

    prefix = await _reset_prefix_cache(target) if plan.reset_prefix_cache else "off"
    if plan.warmup:
        warm = await run_benchmark(*workload(plan.warmup_prompts(load), seed + 999), [], [], {})
        if warm["completed"] == 0:
            raise BenchmarkError(f"Every warm-up request of {plan.unit} {load:g} failed "
                               f"({next((e for e in warm['errors'] if e), '?')}). Is the server up at "
                               f"{target.base_url} and serving {target.model!r}?")
    runs = []
    for rep in range(plan.repeats):
        cfg, samples = workload(plan.prompts(load), seed + rep)
        cfg.show_progress = target.show_progress
        result = await run_benchmark(cfg, samples, PERCENTILES, list(METRIC_KEYS), target.goodput)
        runs.append(_rung_record(result))
    rung = aggregate(runs)
    rung.update(load=load, prefix_cache=prefix)
    if plan.repeats > 1:
        rung["repeats"] = runs
    return rung


def progress_line(i: int, n: int, unit: str, load: float, r: dict) -> str:
    def opt(v, fmt):
        return "n/a" if v is None else fmt(v)

    mem = r.get("server_peak_device_memory_bytes")
    return (f"[{i + 1}/{n}] {unit} {load:g}: {r['completed']} ok, {r['failed']} failed in {r['duration']:.1f} s | "
            f"{r['output_throughput']:,.0f} out tok/s | p95 TTFT {r['p95_ttft_ms']:,.0f} ms, ITL {r['p95_itl_ms']:,.1f} ms, "
            f"E2EL {r['p95_e2el_ms']:,.0f} ms | preemptions {opt(r.get('server_preemptions'), lambda v: f'{v:.0f}')} | "
            f"peak KV {opt(r.get('server_peak_kv_cache_usage'), lambda v: f'{100 * v:.1f}%')}, running "
            f"{opt(r.get('server_peak_num_requests_running'), lambda v: f'{v:.0f}')}, waiting "
            f"{opt(r.get('server_peak_num_requests_waiting'), lambda v: f'{v:.0f}')}, memory "
            f"{opt(mem, lambda v: f'{v / 2**30:.2f} GiB')}"
            + (f" | prefix cache {100 * hits:.0f} % of prompt tokens" if (hits := r.get("server_prefix_cache_hit_rate"))
               else ""))


def run_ladder(plan: SweepPlan, measure: Callable[[int, float], dict],
               on_rung: Callable[[list[dict]], None] | None = None) -> dict:
    """Every rung in order (``measure(index, load)`` gives one: over HTTP, or simulated), then the knee;
    ``on_rung`` sees the rungs so far (to save partial results)."""
    rungs: list[dict] = []
    for i, load in enumerate(plan.loads):
        rung = measure(i, load)
        rungs.append(rung)
        print(progress_line(i, len(plan.loads), plan.unit, load, rung), flush=True)
        if on_rung is not None:
            on_rung(rungs)
    knee = find_knee(rungs, plan.loads, plan.knee, plan.unit)
    return {"rungs": rungs, "knee": knee.to_json()}


def best_ladder(ladders: list[dict]) -> int | None:
    """Of the ladders' recommended rungs, the one with the most output throughput."""
    best, best_thr = None, -1.0
    for i, lad in enumerate(ladders):
        rec = lad["knee"]["recommendation"]
        if rec is not None and lad["rungs"][rec]["output_throughput"] > best_thr:
            best, best_thr = i, lad["rungs"][rec]["output_throughput"]
    return best


def recommendation(ladders: list[dict], plan: SweepPlan, grid_param: str | None) -> dict | None:
    i = best_ladder(ladders)
    if i is None:
        return None
    lad = ladders[i]
    knee = lad["knee"]
    rung = lad["rungs"][knee["recommendation"]]
    out = {"ladder": i, "label": lad["label"], plan.mode: knee["recommended_load"], "reason": knee["recommendation_reason"],
           "output_throughput": rung["output_throughput"], "p95_ttft_ms": rung["p95_ttft_ms"],
           "p95_itl_ms": rung["p95_itl_ms"], "p95_e2el_ms": rung["p95_e2el_ms"]}
    if grid_param is not None:
        out[grid_param] = lad["grid_value"]
        out["reason"] = (f"{lad['label']} at {plan.unit} {knee['recommended_load']:g} gives the most output throughput of the "
                         f"grid's recommendations ({rung['output_throughput']:,.0f} tok/s): {knee['recommendation_reason']}")
    return out


def sweep_document(*, command: list[str], target: dict, model: str, plan: SweepPlan, dataset: dict, endpoint: str,
                   grid: dict | None, ladders: list[dict]) -> dict:
    """``sweep.json``: the configuration, every rung under vLLM's names, each ladder's knee, the pick."""
    return {
        "pagedserve_version": pagedserve.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "target": target,
        "model_id": model,
        "endpoint": endpoint,
        "mode": plan.mode,
        "unit": plan.unit,
        "loads": plan.loads,
        "prompts_per_rung": [plan.prompts(x) for x in plan.loads],
        "warmup": plan.warmup,
        "repeats": plan.repeats,
        "reset_prefix_cache": plan.reset_prefix_cache,
        "dataset": dataset,
        "slo": plan.knee.slo,
        "knee_settings": asdict(plan.knee),
        "grid": grid,
        "ladders": ladders,
        "recommendation": recommendation(ladders, plan, grid["param"] if grid else None),
    }


def goodput_of(slo: dict[str, float]) -> dict[str, float]:
    """Per-request goodput limits (seconds) from the SLO: the tightest limit given for TTFT, TPOT, E2EL."""
    limits = {m: tightest_slo(slo, m) for m in ("ttft", "tpot", "e2el")}
    return {m: ms / 1000.0 for m, ms in limits.items() if ms is not None}


def dataset_settings(ns: argparse.Namespace) -> dict:
    keys = ("dataset_name", "dataset_path", "random_input_len", "random_output_len", "random_range_ratio",
            "random_prefix_len", "sharegpt_output_len", "custom_output_len", "seed")
    return {k: getattr(ns, k) for k in keys}


def samples_factory(ns: argparse.Namespace, tokenizer) -> Callable[[int, int], list[SampleRequest]]:
    from pagedserve.bench.datasets import load_dataset

    def draw(n: int, seed: int) -> list[SampleRequest]:
        return load_dataset(argparse.Namespace(**{**vars(ns), "num_prompts": n, "seed": seed}), tokenizer)

    return draw


def result_dir(path: str | None, command: str = "sweep") -> Path:
    from pagedserve.args import output_dir

    return output_dir(path or f"results/{command}-{time.strftime('%Y%m%d-%H%M%S')}", "--result-dir")


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated numbers, e.g. 1,2,4,8,16,32.") from None


def parse_grid(text: str | None) -> tuple[str, list[str]] | None:
    """``"max_num_seqs=8,16,32"`` -> ("max_num_seqs", ["8", "16", "32"]): one server flag, several values."""
    if text is None:
        return None
    name, sep, values = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name or not vals:
        raise ConfigError(f"--grid {text!r}: use FLAG=V1,V2,... with one `pagedserve serve` flag, e.g. "
                          f"max_num_seqs=16,32,64.")
    if len(set(vals)) < len(vals):
        raise ConfigError(f"--grid {text!r}: list each value once (each starts a server and runs a whole ladder).")
    return name, vals


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def plan_from(ns: argparse.Namespace) -> SweepPlan:
    """The ladder and knee settings from the flags `bench sweep` and `tune` share."""
    given = {mode: getattr(ns, flag[2:].replace("-", "_")) for mode, (flag, _) in LADDERS.items()}
    given = {mode: value for mode, value in given.items() if value is not None}
    if len(given) > 1:
        raise ConfigError(f"Give one of {', '.join(f for f, _ in LADDERS.values())}, not several: one ladder varies "
                          f"one thing.")
    mode, value = next(iter(given.items()), ("concurrency", "1,2,4,8,16,32"))
    if mode == "replay":
        require_recording(ns, "--replay-speeds")
    loads = _float_list(value, LADDERS[mode][0])
    knee = KneeSettings(ns.knee_min_gain, ns.knee_latency_factor, ns.knee_kv_usage, ns.knee_max_failure_rate,
                        parse_slo(ns.slo), _names(ns.knee_signals), _names(ns.knee_latency_metrics))
    return SweepPlan(mode, loads, ns.prompts_per_rung, ns.warmup, ns.repeats, ns.reset_prefix_cache, knee)


def run_sweep(ns: argparse.Namespace, plan: SweepPlan, folder: Path, *, base_url: str | None = None,
              serve_flags: list[str] = (), runs: list[tuple[str, str | None, list[str]]] = (),
              grid: tuple[str, list[str]] | None = None, simulate=None) -> dict:
    """One ladder against ``base_url``, or one per ``runs`` entry (label, grid value, serve flags) against a
    server started for it, or, with ``simulate`` (a ``sim.ladder.Simulation``), against the engine's own
    scheduler on that calibration's cost model. sweep.json is rewritten after every rung and every artefact
    after every ladder, so a sweep cut short keeps what it measured. Returns sweep.json's document."""
    from pagedserve.bench.datasets import announce_dataset, client_tokenizer
    from pagedserve.bench.launch import LocalServer
    from pagedserve.bench.report import write_artefacts

    sampling = request_sampling(ns)
    announce_dataset(ns)
    target_doc = ({"base_url": base_url} if base_url else
                  {"command": ["pagedserve", "serve", ns.model, *serve_flags]})
    if simulate is not None:
        target_doc["simulated"] = simulate.describe()
    ids_only = simulate is not None and ns.dataset_name in LENGTH_DATASETS  # the simulator needs lengths, not text
    tokenizer = None if ids_only else client_tokenizer(ns.tokenizer, ns.model)
    draw = samples_factory(ns, tokenizer)
    goodput = goodput_of(plan.knee.slo)
    ladders: list[dict] = []

    def document() -> dict:
        return sweep_document(command=["pagedserve", *ns.argv], target=target_doc, model=ns.model, plan=plan,
                              dataset=dataset_settings(ns), endpoint=ns.endpoint,
                              grid={"param": grid[0], "values": grid[1]} if grid else None, ladders=ladders)

    def replay_for(n: int | None, speed: float) -> tuple[list[SampleRequest], list[float]]:
        from pagedserve.bench.datasets import replayed_lengths

        return replayed_lengths(ns.dataset_path, n, speed, tokenizer)

    def over_http(url: str) -> Callable[[int, float], dict]:
        target = Target(url, ns.model, ns.endpoint, ns.api_key, ns.ignore_eos or ns.dataset_name in LENGTH_DATASETS,
                        ns.burstiness, ns.seed, goodput, show_progress=not ns.disable_tqdm, sampling=sampling)
        return lambda i, load: asyncio.run(run_rung(target, plan, i, load, draw, replay_for))

    def ladder(measure: Callable[[int, float], dict], label: str, value: str | None, extra: dict) -> None:
        def save_partial(rungs: list[dict]) -> None:
            doc = {**document(), "in_progress": {"label": label, "rungs": rungs}}
            (folder / "sweep.json").write_text(json.dumps(doc, indent=2))

        result = run_ladder(plan, measure, save_partial)
        ladders.append({"label": label, "grid_value": value, **extra, **result})
        if grid:
            print(f"{label}: {result['knee']['reason']}\n{label}: {result['knee']['recommendation_reason']}",
                  flush=True)
        write_artefacts(document(), folder)

    print(f"Sweep: {plan.unit} {', '.join(f'{x:g}' for x in plan.loads)}; results in {folder}", flush=True)
    try:
        if base_url:
            ladder(over_http(base_url), "server", None, {})
        for label, value, flags in runs:
            if simulate is not None:
                ladder(simulate.ladder(ns.model, flags, plan, draw, ns.seed, ns.burstiness, goodput, replay_for),
                       label, value,
                       {"server_command": ["pagedserve", "serve", ns.model, *flags], "simulated": True})
                continue
            log = folder / (f"server-{grid[0]}-{value}.log" if grid else "server.log")
            server = LocalServer(ns.model, flags, log, ns.server_start_timeout)
            print(f"Starting `{' '.join(server.command)}` (log: {log})", flush=True)
            with server:
                ladder(over_http(server.base_url), label, value, {"server_command": server.command,
                                                                  "server_log": log.name})
            ladders[-1]["server_exit_code"] = server.exit_code
    except BenchmarkError as e:  # keep what was measured, say why it stopped
        raise BenchmarkError(f"{e} Results so far are in {folder}.") from e
    doc = document()
    paths = write_artefacts(doc, folder)
    for lad in doc["ladders"] if not grid else ():
        print(lad["knee"]["reason"])
    rec = doc["recommendation"]
    print(f"Recommendation: {rec['reason'] if rec else 'none. ' + doc['ladders'][-1]['knee']['recommendation_reason']}")
    print("Wrote " + ", ".join(str(p) for p in paths), flush=True)
    return doc


def reanalyze(folder: Path, knee: KneeSettings) -> dict:
    """Place the knees and the recommendation again, with other settings, on the rungs a sweep measured
    (sweep.json in ``folder``), and rewrite its artefacts; nothing is measured again."""
    from pagedserve.bench.report import write_artefacts

    path = folder / "sweep.json"
    if not path.is_file():
        raise ConfigError(f"--reanalyze {str(folder)!r}: no sweep.json there.")
    doc = json.loads(path.read_text())
    unit = doc["unit"]
    plan = SweepPlan(doc["mode"], doc["loads"], knee=knee)
    for lad in doc["ladders"]:
        lad["knee"] = find_knee(lad["rungs"], [r["load"] for r in lad["rungs"]], knee, unit).to_json()
        print(f"{lad['label']}: {lad['knee']['reason']}\n{lad['label']}: {lad['knee']['recommendation_reason']}")
    doc.update(slo=knee.slo, knee_settings=asdict(knee),
               recommendation=recommendation(doc["ladders"], plan, doc["grid"]["param"] if doc["grid"] else None),
               reanalyzed={"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "measured": doc["date"]})
    doc.pop("in_progress", None)
    paths = write_artefacts(doc, folder)
    rec = doc["recommendation"]
    print(f"Recommendation: {rec['reason'] if rec else 'none'}\nRewrote " + ", ".join(str(p) for p in paths))
    return doc
