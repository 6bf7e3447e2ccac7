"""``pagedserve bench serve`` and ``pagedserve bench throughput`` (vLLM bench's flags)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from pagedserve.errors import ConfigError


def _add_dataset_args(p: argparse.ArgumentParser, client: bool, num_prompts: bool = True) -> None:
    """Dataset flags; ``client``: also --seed and --tokenizer (bench throughput has the engine's);
    ``num_prompts``: False where the command sizes each run itself (bench sweep)."""
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", choices=["random", "sharegpt", "custom"], default="random")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON or custom JSONL ({\"prompt\", \"output_len\"}).")
    if num_prompts:
        d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [L(1-r), L(1+r)].")
    d.add_argument("--random-prefix-len", type=int, default=0, help="A shared prefix of this many tokens.")
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--custom-output-len", type=int, default=256)
    if client:
        d.add_argument("--seed", type=int, default=0)
        d.add_argument("--tokenizer", default=None,
                       help="Client-side tokenizer folder (default: the model, if it is a local folder). "
                            "Without one, random prompts are sent as token ids.")


def _client_tokenizer(ns):
    from pathlib import Path as P

    from pagedserve.model.tiny import TINY_MODEL_NAMES, ensure_tiny_model

    path = ns.tokenizer or ns.model
    if path in TINY_MODEL_NAMES:
        path = str(ensure_tiny_model())
    if path and (P(path) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    if ns.tokenizer:
        raise ConfigError(f"--tokenizer {ns.tokenizer!r} is not a tokenizer folder.")
    return None


def _save(ns, result: dict, default_name: str) -> None:
    if not (ns.save_result or ns.result_filename or ns.result_dir):
        return
    folder = Path(ns.result_dir or ".")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (ns.result_filename or default_name)
    path.write_text(json.dumps(result, indent=2))
    print(f"Saved the result to {path}")


def cmd_bench_serve(ns: argparse.Namespace) -> None:
    from pagedserve.bench.datasets import load_dataset
    from pagedserve.bench.metrics import METRIC_KEYS, parse_goodput
    from pagedserve.bench.serve import BenchConfig, format_table, run_benchmark

    if ns.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1.")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be at least 1.")
    if ns.request_rate <= 0 or ns.burstiness <= 0:
        raise ConfigError("--request-rate and --burstiness must be positive.")
    pct_metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in pct_metrics if m not in METRIC_KEYS]
    if bad:
        raise ConfigError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRIC_KEYS)}.")
    try:
        percentiles = [float(p) for p in ns.metric_percentiles.split(",")]
        goodput = parse_goodput(ns.goodput)
    except ValueError as e:
        raise ConfigError(f"--metric-percentiles/--goodput: {e}") from e
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ConfigError("--metric-percentiles must be in [0, 100].")
    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    model = ns.model or _served_model(base, ns.api_key)
    ns.model = model
    samples = load_dataset(ns, _client_tokenizer(ns))
    cfg = BenchConfig(base_url=base, endpoint=ns.endpoint, model=model, request_rate=ns.request_rate,
                      burstiness=ns.burstiness, max_concurrency=ns.max_concurrency,
                      ignore_eos=ns.ignore_eos or ns.dataset_name == "random", seed=ns.seed,
                      num_warmups=ns.num_warmups, api_key=ns.api_key, show_progress=not ns.disable_tqdm)
    try:
        result = asyncio.run(run_benchmark(cfg, samples, percentiles, pct_metrics, goodput))
    except RuntimeError as e:
        print(f"pagedserve bench serve: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(format_table(result, pct_metrics, percentiles))
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
    conc = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
    _save(ns, result, f"openai-{rate}qps{conc}-{model.split('/')[-1]}-{result['date']}.json")


def _served_model(base: str, api_key: str | None) -> str:
    import httpx

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.get(f"{base}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"No --model given and {base}/v1/models did not name one ({e}).") from e


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated numbers, e.g. 1,2,4,8,16,32.") from None


def _grid(text: str | None) -> tuple[str, list[str]] | None:
    """``"max_num_seqs=8,16,32"`` -> ("max_num_seqs", ["8", "16", "32"]): one server flag, several values."""
    if text is None:
        return None
    name, sep, values = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name or not vals:
        raise ConfigError(f"--grid {text!r}: use FLAG=V1,V2,... with one `pagedserve serve` flag, e.g. max_num_seqs=16,32,64.")
    return name, vals


def cmd_bench_sweep(ns: argparse.Namespace) -> None:
    from pagedserve.bench.knee import KneeSettings, parse_slo
    from pagedserve.bench.launch import LocalServer, check_serve_flags, serve_flags, with_flag
    from pagedserve.bench.report import write_artefacts
    from pagedserve.bench.sweep import (SweepPlan, Target, dataset_settings, goodput_of, result_dir, run_ladder,
                                        samples_factory, sweep_document)

    if ns.request_rates is not None and ns.concurrency is not None:
        raise ConfigError("Give --concurrency or --request-rates, not both: one ladder varies one thing.")
    rates = ns.request_rates is not None
    loads = _float_list(ns.request_rates if rates else ns.concurrency or "1,2,4,8,16,32",
                        "--request-rates" if rates else "--concurrency")
    slo = parse_slo(ns.slo)
    signals = tuple(x.strip() for x in ns.knee_signals.split(",") if x.strip())
    plan = SweepPlan("rate" if rates else "concurrency", loads, ns.prompts_per_rung, ns.warmup, ns.repeats,
                     ns.reset_prefix_cache,
                     KneeSettings(ns.knee_min_gain, ns.knee_latency_factor, ns.knee_kv_usage, ns.knee_max_failure_rate,
                                  slo, signals))
    external = ns.base_url is not None or ns.host is not None or ns.port is not None
    grid = _grid(ns.grid)
    if external and (ns.serve_args or grid):
        raise ConfigError("--serve-args and --grid start servers of the sweep's own; they cannot be used with "
                          "--base-url/--host/--port (a server that is already running).")
    if not external and ns.model is None:
        raise ConfigError("Give --base-url (or --host/--port) of a running server, or --model to start one.")
    flags = serve_flags(ns.serve_args)
    runs = [(f"{grid[0]}={v}", v, with_flag(flags, grid[0], v)) for v in grid[1]] if grid else [("server", None, flags)]
    if not external:
        for _, _, server_flags in runs:
            check_serve_flags(ns.model, server_flags)
        target_doc = {"command": ["pagedserve", "serve", ns.model, *flags]}
    else:
        base = (ns.base_url or f"http://{ns.host or '127.0.0.1'}:{ns.port or 8000}").rstrip("/")
        ns.model = ns.model or _served_model(base, ns.api_key)
        target_doc = {"base_url": base}
    folder = result_dir(ns.result_dir)
    tokenizer = _client_tokenizer(ns)
    ladders: list[dict] = []

    def document() -> dict:
        return sweep_document(command=["pagedserve", *ns.argv], target=target_doc, model=ns.model, plan=plan,
                              dataset=dataset_settings(ns), endpoint=ns.endpoint,
                              grid={"param": grid[0], "values": grid[1]} if grid else None, ladders=ladders)

    def save_partial(label: str, rungs: list[dict]) -> None:
        (folder / "sweep.json").write_text(json.dumps({**document(), "in_progress": {"label": label, "rungs": rungs}},
                                                      indent=2))

    def ladder(base_url: str, label: str, value: str | None, extra: dict) -> None:
        target = Target(base_url, ns.model, ns.endpoint, ns.api_key, ns.ignore_eos or ns.dataset_name == "random",
                        ns.burstiness, ns.seed, goodput_of(slo), show_progress=not ns.disable_tqdm)
        result = run_ladder(target, plan, samples_factory(ns, tokenizer), lambda rungs: save_partial(label, rungs))
        ladders.append({"label": label, "grid_value": value, **extra, **result})
        if grid:
            print(f"{label}: {result['knee']['reason']}\n{label}: {result['knee']['recommendation_reason']}", flush=True)
        write_artefacts(document(), folder)

    print(f"Sweep: {plan.unit} {', '.join(f'{x:g}' for x in loads)}; results in {folder}", flush=True)
    try:
        if external:
            ladder(target_doc["base_url"], "server", None, {})
        for label, value, server_flags in ([] if external else runs):
            log = folder / (f"server-{grid[0]}-{value}.log" if grid else "server.log")
            server = LocalServer(ns.model, server_flags, log, ns.server_start_timeout)
            print(f"Starting `{' '.join(server.command)}` (log: {log})", flush=True)
            with server:
                ladder(server.base_url, label, value, {"server_command": server.command, "server_log": log.name})
            ladders[-1]["server_exit_code"] = server.exit_code
    except RuntimeError as e:  # the load could not run (warm-up failed): keep what was measured, say why
        print(f"pagedserve bench sweep: error: {e} Results so far are in {folder}.", file=sys.stderr)
        sys.exit(1)
    paths = write_artefacts(document(), folder)
    doc = document()
    for lad in doc["ladders"] if not grid else ():
        print(lad["knee"]["reason"])
    rec = doc["recommendation"]
    print(f"Recommendation: {rec['reason'] if rec else 'none. ' + doc['ladders'][-1]['knee']['recommendation_reason']}")
    print("Wrote " + ", ".join(str(p) for p in paths))


def cmd_bench_throughput(ns: argparse.Namespace) -> None:
    import dataclasses

    from pagedserve import LLM
    from pagedserve.bench.datasets import load_dataset
    from pagedserve.bench.throughput import run_throughput
    from pagedserve.cli import engine_args_from

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    samples = load_dataset(ns, llm.get_tokenizer())
    result = run_throughput(llm, samples, use_tqdm=not ns.disable_tqdm)
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
          f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    print(f"Preemptions: {result['num_preemptions']}; peak device memory: "
          f"{result['peak_device_memory_bytes'] / 2**30:.2f} GiB")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(result, indent=2))
        print(f"Saved the result to {ns.output_json}")


def add_bench_parser(sub) -> None:
    from pagedserve.cli import add_engine_args

    bench = sub.add_parser("bench", help="Benchmarks: serve (online, over HTTP) and throughput (offline).")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    s = bsub.add_parser("serve", help="Online load test against an OpenAI-compatible server.")
    s.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    s.add_argument("--model", default=None, help="Model name sent in requests (default: the server's first).")
    s.add_argument("--api-key", default=None)
    _add_dataset_args(s, client=True)
    s.add_argument("--request-rate", type=float, default=math.inf, help="Requests per second (default inf: all at once).")
    s.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrivals; 1 = Poisson.")
    s.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight from this client.")
    s.add_argument("--ignore-eos", action="store_true", help="Always on for the random dataset.")
    s.add_argument("--num-warmups", type=int, default=1)
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    s.add_argument("--metric-percentiles", default="99")
    s.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000.")
    s.add_argument("--save-result", action="store_true")
    s.add_argument("--result-dir", default=None)
    s.add_argument("--result-filename", default=None)
    s.add_argument("--disable-tqdm", action="store_true")
    s.set_defaults(func=cmd_bench_serve)

    w = bsub.add_parser("sweep", help="The staged load test: a concurrency (or rate) ladder, its knee, a "
                                      "recommendation, and a report.")
    g = w.add_argument_group("target (a running server, or one the sweep starts)")
    g.add_argument("--base-url", default=None, help="A running OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
    g.add_argument("--host", default=None, help="Host of a running server (with --port).")
    g.add_argument("--port", type=int, default=None, help="Port of a running server.")
    g.add_argument("--model", default=None,
                   help="Without --base-url/--host/--port: the model to start `pagedserve serve` with (a local "
                        "folder, tiny, or a built-in name with --serve-args '--load-format dummy'). With them: the "
                        "name sent in requests (default: the server's first).")
    g.add_argument("--serve-args", default="", help="Flags for the started server, e.g. \"--max-num-seqs 16 "
                                                    "--max-num-batched-tokens 4096\".")
    g.add_argument("--grid", default=None,
                   help="Repeat the ladder for each value of one server flag, e.g. max_num_seqs=16,32,64 (one "
                        "variable at a time).")
    g.add_argument("--server-start-timeout", type=float, default=900.0, help="Seconds to wait for /health.")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--api-key", default=None)
    _add_dataset_args(w, client=True, num_prompts=False)
    lad = w.add_argument_group("ladder")
    lad.add_argument("--concurrency", default=None,
                     help="Requests in flight per rung (closed loop, --request-rate inf --max-concurrency C); "
                          "default 1,2,4,8,16,32.")
    lad.add_argument("--request-rates", default=None, help="Or an open-loop ladder of request rates, e.g. 1,2,4,8.")
    lad.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrivals for --request-rates.")
    lad.add_argument("--prompts-per-rung", type=int, default=None,
                     help="Measured prompts per rung (default: max(16, 4C), or max(16, 10R) for rates).")
    lad.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="One unmeasured round of requests at each rung's load first.")
    lad.add_argument("--repeats", type=int, default=1, help="Measure each rung this many times (medians).")
    lad.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="POST /reset_prefix_cache before each rung, where the server has it.")
    lad.add_argument("--ignore-eos", action="store_true", help="Always on for the random dataset.")
    k = w.add_argument_group("knee and recommendation")
    k.add_argument("--slo", nargs="+", default=None,
                   help="Limits in ms a recommended rung must meet, e.g. ttft_p95=500 itl_p95=50 e2el_p99=10000.")
    k.add_argument("--knee-min-gain", type=float, default=0.10,
                   help="Knee when output throughput grows less than this per doubling of the load.")
    k.add_argument("--knee-latency-factor", type=float, default=3.0,
                   help="Knee when p95 TTFT, ITL or E2EL exceeds this multiple of the lowest rung's.")
    k.add_argument("--knee-kv-usage", type=float, default=0.90, help="Knee when peak KV-cache usage reaches this.")
    k.add_argument("--knee-max-failure-rate", type=float, default=0.0,
                   help="Knee when more than this fraction of a rung's requests fail.")
    k.add_argument("--knee-signals", default="throughput,latency,preemption,kv_cache,failures,slo",
                   help="Signals that can place the knee (kneedle too, if listed).")
    w.add_argument("--result-dir", default=None, help="Where the artefacts go (default results/sweep-DATE).")
    w.add_argument("--disable-tqdm", action="store_true")
    w.set_defaults(func=cmd_bench_sweep)

    t = bsub.add_parser("throughput", help="Offline batch throughput with the in-process engine.")
    add_engine_args(t, positional_model=False)
    _add_dataset_args(t, client=False)
    t.add_argument("--output-json", default=None)
    t.add_argument("--disable-tqdm", action="store_true")
    t.set_defaults(func=cmd_bench_throughput)
