"""``pagedserve bench latency``: how long one batch takes, in-process (vLLM's ``bench latency``).

Each iteration sends --batch-size prompts of --input-len random tokens (new ones each time, so that no
iteration's prefill is served from the prefix cache), each for --output-len tokens (ignore_eos), steps
the engine until all finish, and times it. vLLM reports the end-to-end latency of the batch; this also
reports the time to the first token and the gaps between tokens (ITL), taken when tokens reach the
caller, which with one request is the decode step the user sees.
"""

from __future__ import annotations

import time

import numpy as np

from pagedserve.bench.datasets import NO_TOKENIZER_VOCAB
from pagedserve.errors import ConfigError

PERCENTILES = (10, 25, 50, 75, 90, 99)


def one_batch(engine, prompts: list[list[int]], params, tag: str) -> tuple[float, float, list[float]]:
    """(latency, time to the first token, gaps between steps that produced tokens) of one batch."""
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return time.perf_counter() - t0, stamps[0] - t0, list(np.diff(stamps))


def run_latency(llm, input_len: int, output_len: int, batch_size: int, num_iters_warmup: int, num_iters: int,
                seed: int = 0, temperature: float = 1.0) -> dict:
    from pagedserve import SamplingParams

    if min(input_len, output_len, batch_size, num_iters) < 1 or num_iters_warmup < 0:
        raise ConfigError("--input-len, --output-len, --batch-size and --num-iters must be at least 1.")
    limit = llm.engine.config.max_model_len
    if input_len + output_len > limit:
        raise ConfigError(f"--input-len {input_len} + --output-len {output_len} = {input_len + output_len} tokens, "
                          f"more than --max-model-len {limit}: lower them or raise --max-model-len.")
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine

    def prompts() -> list[list[int]]:  # new ones each batch: a repeated prompt would be served from the prefix cache
        return rng.integers(0, NO_TOKENIZER_VOCAB, size=(batch_size, input_len)).tolist()

    for i in range(num_iters_warmup):
        one_batch(engine, prompts(), params, f"warmup{i}")
    latencies, ttfts, itls = [], [], []
    for i in range(num_iters):
        latency, ttft, gaps = one_batch(engine, prompts(), params, f"iter{i}")
        latencies.append(latency)
        ttfts.append(ttft)
        itls.extend(gaps)
    lat, itl = np.asarray(latencies), np.asarray(itls) * 1000
    return {
        "avg_latency": float(lat.mean()),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "mean_ttft_ms": float(np.mean(ttfts)) * 1000,
        "mean_itl_ms": float(itl.mean()) if itl.size else None,
        "median_itl_ms": float(np.median(itl)) if itl.size else None,
        "p99_itl_ms": float(np.percentile(itl, 99)) if itl.size else None,
    }


def format_result(r: dict) -> str:
    lines = [f"Avg latency: {r['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {v:.4f} seconds" for p, v in r["percentiles"].items()]
    if r["mean_itl_ms"] is not None:
        lines.append(f"TTFT: mean {r['mean_ttft_ms']:.2f} ms; ITL: mean {r['mean_itl_ms']:.3f} ms, "
                     f"median {r['median_itl_ms']:.3f} ms, p99 {r['p99_itl_ms']:.3f} ms")
    return "\n".join(lines)
