"""``pagedserve bench serve`` and ``pagedserve bench throughput`` (vLLM bench's flags)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from pagedserve.args import fraction, non_negative_int, positive_float, positive_int, tcp_port
from pagedserve.errors import ConfigError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # the APIs bench serve and sweep drive


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """How each request samples (vLLM bench's flags), for the clients that send them."""
    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0, help="Every request's temperature (0: greedy).")
    r.add_argument("--top-p", type=float, default=None)
    r.add_argument("--top-k", type=int, default=None)
    r.add_argument("--min-p", type=float, default=None)
    r.add_argument("--extra-body", default=None,
                   help="JSON fields added to every request, e.g. '{\"chat_template_kwargs\": {\"enable_thinking\": "
                        "false}}' for Qwen3 over /v1/chat/completions.")


def _add_dataset_args(p: argparse.ArgumentParser, client: bool, num_prompts: bool = True,
                      short_lens: bool = False) -> None:
    """Dataset flags; ``client``: also --seed and --tokenizer (bench throughput has the engine's);
    ``num_prompts``: False where the command sizes each run itself (bench sweep); ``short_lens``: also
    --input-len / --output-len, as vLLM's bench throughput names the random lengths."""
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", choices=["random", "sharegpt", "custom", "lengths"], default="random",
                   help="lengths: random prompts with the prompt and output lengths of the requests a server "
                        "recorded (`serve --record-lengths FILE`), to load-test with production's shape.")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON, custom JSONL ({\"prompt\", \"output_len\"}), "
                                                        "or a --record-lengths file.")
    if num_prompts:
        d.add_argument("--num-prompts", type=positive_int, default=1000)
    d.add_argument("--random-input-len", *(("--input-len",) if short_lens else ()), type=positive_int, default=1024)
    d.add_argument("--random-output-len", *(("--output-len",) if short_lens else ()), type=positive_int,
                   default=128)
    d.add_argument("--random-range-ratio", type=fraction, default=0.0,
                   help="Lengths uniform in [L(1-r), L(1+r)].")
    d.add_argument("--random-prefix-len", type=non_negative_int, default=0, help="A shared prefix of this many tokens.")
    d.add_argument("--sharegpt-output-len", type=positive_int, default=None)
    d.add_argument("--custom-output-len", type=positive_int, default=256)
    if client:
        d.add_argument("--seed", type=int, default=0)
        d.add_argument("--tokenizer", default=None,
                       help="Client-side tokenizer folder (default: the model, if it is a local folder). "
                            "Without one, random prompts are sent as token ids.")


def _write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=2))
        print(f"Saved the result to {path}")


def cmd_bench_serve(ns: argparse.Namespace) -> None:
    from pagedserve.args import output_dir
    from pagedserve.bench.datasets import (LENGTH_DATASETS, announce_dataset, client_tokenizer, load_dataset,
                                           replayed_lengths, require_recording)
    from pagedserve.bench.metrics import METRIC_KEYS, parse_goodput
    from pagedserve.bench.serve import (BenchConfig, format_table, request_sampling, run_benchmark,
                                        served_model)

    if not ns.request_rate > 0:  # nan fails it too
        raise ConfigError("--request-rate must be above 0 (inf: all at once).")
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
    sampling = request_sampling(ns)
    if ns.replay_arrivals:
        require_recording(ns, "--replay-arrivals")
    if ns.replay_arrivals and not math.isinf(ns.request_rate):
        raise ConfigError("--replay-arrivals sends each request when it was recorded; leave out --request-rate "
                          "(use --replay-speed to replay faster or slower).")
    announce_dataset(ns)
    saved = ns.save_result or ns.result_filename or ns.result_dir
    folder = output_dir(ns.result_dir or ".", "--result-dir") if saved else None
    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    model = ns.model or served_model(base, ns.api_key)
    ns.model = model
    tokenizer, arrivals = client_tokenizer(ns.tokenizer, ns.model), None
    if ns.replay_arrivals:
        samples, arrivals = replayed_lengths(ns.dataset_path, ns.num_prompts, ns.replay_speed, tokenizer)
    else:
        samples = load_dataset(ns, tokenizer)
    cfg = BenchConfig(base_url=base, endpoint=ns.endpoint, model=model, request_rate=ns.request_rate,
                      burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, arrivals=arrivals,
                      replay_speed=ns.replay_speed if ns.replay_arrivals else None,
                      ignore_eos=ns.ignore_eos or ns.dataset_name in LENGTH_DATASETS, sampling=sampling,
                      seed=ns.seed, num_warmups=ns.num_warmups, api_key=ns.api_key, show_progress=not ns.disable_tqdm)
    result = asyncio.run(run_benchmark(cfg, samples, percentiles, pct_metrics, goodput))
    print(format_table(result, pct_metrics, percentiles))
    hits = result.get("server_prefix_cache_hit_rate")
    # a preempted request's recompute finds its own earlier blocks: then the hits say nothing of the seed
    if hits and ns.dataset_name == "random" and not ns.random_prefix_len and not result.get("server_preemptions"):
        print(f"Note: {100 * hits:.0f} % of the prompt tokens were found in the server's prefix cache, though these "
              f"random prompts share nothing: most likely a run before this one sent them (same --seed). Their "
              f"TTFT is not a prefill's; use another --seed, or POST /reset_prefix_cache first.", file=sys.stderr)
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
    conc = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
    name = ns.result_filename or f"openai-{rate}qps{conc}-{model.split('/')[-1]}-{result['date']}.json"
    _write_json(folder / name if folder else None, result)


def cmd_bench_sweep(ns: argparse.Namespace) -> None:
    from pagedserve.bench.launch import check_serve_flags, serve_flags, with_flag
    from pagedserve.bench.serve import served_model
    from pagedserve.bench.sweep import parse_grid, plan_from, result_dir, run_sweep

    plan = plan_from(ns)
    if ns.reanalyze is not None:
        from pagedserve.bench.sweep import reanalyze

        reanalyze(Path(ns.reanalyze), plan.knee)
        return
    external = ns.base_url is not None or ns.host is not None or ns.port is not None
    grid = parse_grid(ns.grid)
    if external and (ns.serve_args or grid or ns.simulate):
        raise ConfigError("--serve-args, --grid and --simulate describe servers of the sweep's own; they cannot be "
                          "used with --base-url/--host/--port (a server that is already running).")
    if not external and ns.model is None:
        raise ConfigError("Give --base-url (or --host/--port) of a running server, or --model to start one"
                          + (" (--simulate needs --model too)." if ns.simulate else "."))
    if (ns.gpu_memory is not None or ns.gpu is not None) and not ns.simulate:
        raise ConfigError("--gpu and --gpu-memory size a simulated GPU: give them with --simulate.")
    flags = serve_flags(ns.serve_args)
    if external:
        base = (ns.base_url or f"http://{ns.host or '127.0.0.1'}:{ns.port or 8000}").rstrip("/")
        ns.model = ns.model or served_model(base, ns.api_key)
        run_sweep(ns, plan, result_dir(ns.result_dir), base_url=base)
        return
    runs = [(f"{grid[0]}={v}", v, with_flag(flags, grid[0], v)) for v in grid[1]] if grid else [("server", None, flags)]
    for label, _, server_flags in runs:
        try:
            check_serve_flags(ns.model, server_flags)
        except ConfigError as e:  # name the grid's value, which the flags alone do not show came from it
            if not grid:
                raise
            raise ConfigError(f"--grid {label}: `pagedserve serve {ns.model} {' '.join(server_flags)}` is not a "
                              f"valid command line (see the message above).") from e
    simulate = None
    if ns.simulate:
        from pagedserve.sim.ladder import Simulation

        simulate = Simulation.load(ns.simulate, ns.gpu_memory, ns.gpu)
        for _, _, server_flags in runs:  # every engine of the grid starts on the simulated GPU
            simulate.engine(ns.model, server_flags)
    run_sweep(ns, plan, result_dir(ns.result_dir), serve_flags=flags, runs=runs, grid=grid, simulate=simulate)


def cmd_bench_throughput(ns: argparse.Namespace) -> None:
    import dataclasses

    from pagedserve import LLM
    from pagedserve.bench.datasets import announce_dataset, load_dataset
    from pagedserve.bench.throughput import run_throughput
    from pagedserve.args import engine_args_from, output_path

    announce_dataset(ns)
    out = output_path(ns.output_json, "--output-json")
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
    _write_json(out, result)


def cmd_bench_latency(ns: argparse.Namespace) -> None:
    import dataclasses

    from pagedserve import LLM
    from pagedserve.bench.latency import format_result, run_latency
    from pagedserve.args import engine_args_from, output_path

    out = output_path(ns.output_json, "--output-json")
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    result = run_latency(llm, ns.input_len, ns.output_len, ns.batch_size, ns.num_iters_warmup, ns.num_iters, ns.seed)
    print(format_result(result))
    _write_json(out, result)


def cmd_bench_quality(ns: argparse.Namespace) -> None:
    import dataclasses

    from pagedserve.bench.quality import run_quality
    from pagedserve.args import engine_args_from, output_path

    out = output_path(ns.output_json, "--output-json")
    result = run_quality(engine_args_from(ns), ns.reference_kv_cache_dtype, ns.num_prompts, ns.max_tokens,
                         ns.top_logprobs, ns.min_agreement, ns.max_logprob_diff, ns.max_perplexity_increase)
    print(result.text())
    _write_json(out, dataclasses.asdict(result))
    if not result.passed:
        raise SystemExit(1)  # scripts can gate a profile's fp8 step on it


def add_ladder_args(p: argparse.ArgumentParser, client: bool = True) -> None:
    """The workload, the ladder and the knee: flags `bench sweep` and `tune` share (``client``: the sweep's
    own --seed and --tokenizer; tune has the engine's)."""
    p.add_argument("--server-start-timeout", type=positive_float, default=900.0, help="Seconds to wait for /health.")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    _add_dataset_args(p, client=client, num_prompts=False)
    lad = p.add_argument_group("ladder")
    lad.add_argument("--concurrency", default=None,
                     help="Requests in flight per rung (closed loop, --request-rate inf --max-concurrency C); "
                          "default 1,2,4,8,16,32.")
    lad.add_argument("--request-rates", default=None, help="Or an open-loop ladder of request rates, e.g. 1,2,4,8.")
    lad.add_argument("--replay-speeds", default=None,
                     help="Or replay a recording (--dataset-name lengths) at these multiples of its arrival rate, "
                          "e.g. 1,2,4,8: how many times today's traffic the server takes before the knee.")
    lad.add_argument("--burstiness", type=positive_float, default=1.0,
                     help="Gamma shape of arrivals for --request-rates.")
    lad.add_argument("--prompts-per-rung", type=positive_int, default=None,
                     help="Measured prompts per rung (default: max(16, 4C), max(16, 10R) for rates, the whole "
                          "recording for replay speeds: its first N requests with this flag).")
    lad.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="One unmeasured round of requests at each rung's load first.")
    lad.add_argument("--repeats", type=positive_int, default=1, help="Measure each rung this many times (medians).")
    lad.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="POST /reset_prefix_cache before each rung, where the server has it.")
    lad.add_argument("--ignore-eos", action="store_true", help="Always on for the random dataset.")
    _add_request_args(p)
    k = p.add_argument_group("knee and recommendation")
    k.add_argument("--slo", nargs="+", default=None,
                   help="Limits in ms a recommended rung must meet, e.g. ttft_p95=500 itl_p95=50 e2el_p99=10000.")
    k.add_argument("--knee-min-gain", type=float, default=0.10,
                   help="Knee when output throughput grows less than this per doubling of the load, from the rung "
                        "before to this one and to every higher one.")
    k.add_argument("--knee-latency-factor", type=float, default=3.0,
                   help="Knee when the p95 of a --knee-latency-metrics metric exceeds this multiple of the lowest "
                        "rung's (for metrics without an --slo).")
    k.add_argument("--knee-latency-metrics", default="itl,e2el",
                   help="Metrics the latency signal watches (ttft too, if listed; a TTFT target is better given "
                        "as --slo ttft_p95=MS).")
    k.add_argument("--knee-kv-usage", type=float, default=0.90, help="Knee when peak KV-cache usage reaches this.")
    k.add_argument("--knee-max-failure-rate", type=float, default=0.0,
                   help="Knee when more than this fraction of a rung's requests fail.")
    k.add_argument("--knee-signals", default="throughput,latency,preemption,kv_cache,failures,slo",
                   help="Signals that can place the knee (kneedle and host too, if listed).")
    p.add_argument("--result-dir", default=None, help="Where the artefacts go (default results/<command>-DATE).")
    p.add_argument("--disable-tqdm", action="store_true")


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    from pagedserve.sim.cost import shipped
    from pagedserve.tune.plan import GPU_PRESETS

    g = p.add_argument_group("simulation (no GPU)")
    g.add_argument("--simulate", default=None, metavar="CALIBRATION",
                   help="Run the ladder on the engine's own scheduler with steps priced by a calibration (a file "
                        "from `pagedserve calibrate`, or a shipped one: " + ", ".join(sorted(shipped())) + ").")
    g.add_argument("--gpu", choices=list(GPU_PRESETS), default=None,
                   help="Simulate this GPU: its memory, and the calibration's step times scaled by the ratios of "
                        "its spec-sheet compute and bandwidth peaks to the calibration GPU's (an estimate).")
    g.add_argument("--gpu-memory", type=positive_float, default=None,
                   help="GiB of the simulated GPU (overrides --gpu; default: the calibration GPU's).")


def add_bench_parser(sub) -> None:
    from pagedserve.args import add_engine_args

    bench = sub.add_parser("bench", help="Benchmarks: serve and sweep (online, over HTTP), throughput and latency "
                                         "(offline), quality (fp8 KV cache against 16-bit).")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench.set_defaults(func=lambda ns: bench.print_help())

    s = bsub.add_parser("serve", help="Online load test against an OpenAI-compatible server.")
    s.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=tcp_port, default=8000)
    s.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    s.add_argument("--model", default=None, help="Model name sent in requests (default: the server's first).")
    s.add_argument("--api-key", default=None)
    _add_dataset_args(s, client=True)
    s.add_argument("--request-rate", type=float, default=math.inf, help="Requests per second (default inf: all at once).")
    s.add_argument("--burstiness", type=positive_float, default=1.0, help="Gamma shape of arrivals; 1 = Poisson.")
    s.add_argument("--replay-arrivals", action="store_true",
                   help="With --dataset-name lengths: send the first --num-prompts recorded requests at their "
                        "recorded times (offsets from the first), instead of at --request-rate.")
    s.add_argument("--replay-speed", type=positive_float, default=1.0,
                   help="With --replay-arrivals: how much faster than recorded (2: the gaps halved).")
    s.add_argument("--max-concurrency", type=positive_int, default=None, help="Most requests in flight from this client.")
    s.add_argument("--ignore-eos", action="store_true", help="Always on for the random dataset.")
    _add_request_args(s)
    s.add_argument("--num-warmups", type=non_negative_int, default=1,
                   help="Unmeasured requests before the run (the first prompt with its halves swapped, so "
                        "no measured prompt finds it cached).")
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
    g.add_argument("--port", type=tcp_port, default=None, help="Port of a running server.")
    g.add_argument("--model", default=None,
                   help="Without --base-url/--host/--port: the model to start `pagedserve serve` with (a local "
                        "folder, tiny, or a built-in name with --serve-args '--load-format dummy'). With them: the "
                        "name sent in requests (default: the server's first).")
    g.add_argument("--serve-args", default="", help="Flags for the started server, e.g. \"--max-num-seqs 16 "
                                                    "--max-num-batched-tokens 4096\".")
    g.add_argument("--grid", default=None,
                   help="Repeat the ladder for each value of one server flag, e.g. max_num_seqs=16,32,64 (one "
                        "variable at a time).")
    g.add_argument("--api-key", default=None)
    add_simulate_args(w)
    w.add_argument("--reanalyze", default=None, metavar="DIR",
                   help="Measure nothing: place the knee and the recommendation again, with the knee and --slo "
                        "flags given, on the rungs a sweep saved in DIR/sweep.json, and rewrite its artefacts.")
    add_ladder_args(w)
    w.set_defaults(func=cmd_bench_sweep)

    lat = bsub.add_parser("latency", help="End-to-end latency of one batch, in-process (TTFT and ITL too).")
    add_engine_args(lat, positional_model=False)
    g = lat.add_argument_group("latency")
    g.add_argument("--input-len", type=positive_int, default=32)
    g.add_argument("--output-len", type=positive_int, default=128)
    g.add_argument("--batch-size", type=positive_int, default=8)
    g.add_argument("--num-iters-warmup", type=non_negative_int, default=10)
    g.add_argument("--num-iters", type=positive_int, default=30)
    g.add_argument("--output-json", default=None)
    lat.set_defaults(func=cmd_bench_latency)

    q = bsub.add_parser("quality", help="Compare greedy tokens and logprobs of a cheaper KV cache (fp8) with the "
                                        "16-bit one on fixed prompts, and give a verdict.")
    add_engine_args(q)
    q.set_defaults(kv_cache_dtype="fp8")
    g = q.add_argument_group("quality check")
    g.add_argument("--reference-kv-cache-dtype", default="auto", help="The cache to compare against (auto: the "
                                                                      "model's dtype).")
    g.add_argument("--num-prompts", type=positive_int, default=16)
    g.add_argument("--max-tokens", type=positive_int, default=64)
    g.add_argument("--top-logprobs", type=int, default=5)
    g.add_argument("--min-agreement", type=float, default=0.90,
                   help="Pass needs at least this share of each completion identical before the first divergence.")
    g.add_argument("--max-logprob-diff", type=float, default=0.05,
                   help="Pass needs the mean |Δ logprob| of the chosen tokens at or below this.")
    g.add_argument("--max-perplexity-increase", type=float, default=0.02,
                   help="Pass needs the candidate's perplexity on the reference's completions at most this much "
                        "above the reference's own (0.02: 2 %%).")
    g.add_argument("--output-json", default=None)
    q.set_defaults(func=cmd_bench_quality)

    t = bsub.add_parser("throughput", help="Offline batch throughput with the in-process engine.")
    add_engine_args(t, positional_model=False)
    _add_dataset_args(t, client=False, short_lens=True)
    t.add_argument("--output-json", default=None)
    t.add_argument("--disable-tqdm", action="store_true")
    t.set_defaults(func=cmd_bench_throughput)
