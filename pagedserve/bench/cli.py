"""``pagedserve bench serve`` and ``pagedserve bench throughput`` (vLLM bench's flags)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from pagedserve.errors import ConfigError


def _add_dataset_args(p: argparse.ArgumentParser, client: bool) -> None:
    """Dataset flags; ``client``: also --seed and --tokenizer (bench throughput has the engine's)."""
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", choices=["random", "sharegpt", "custom"], default="random")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON or custom JSONL ({\"prompt\", \"output_len\"}).")
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

    t = bsub.add_parser("throughput", help="Offline batch throughput with the in-process engine.")
    add_engine_args(t, positional_model=False)
    _add_dataset_args(t, client=False)
    t.add_argument("--output-json", default=None)
    t.add_argument("--disable-tqdm", action="store_true")
    t.set_defaults(func=cmd_bench_throughput)
