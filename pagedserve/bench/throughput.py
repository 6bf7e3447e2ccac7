"""``pagedserve bench throughput``: offline batch throughput, in-process, with the engine's own flags."""

from __future__ import annotations

import time

from pagedserve.bench.datasets import SampleRequest
from pagedserve.errors import ConfigError


def run_throughput(llm, samples: list[SampleRequest], use_tqdm: bool = True) -> dict:
    """All requests at once, ``ignore_eos`` so each produces exactly its output length (as vLLM)."""
    from pagedserve import SamplingParams

    limit = llm.engine.config.max_model_len
    over = [s for s in samples if s.prompt_len + s.expected_output_len > limit]
    if over:
        worst = max(over, key=lambda s: s.prompt_len + s.expected_output_len)
        raise ConfigError(f"{len(over)} of the {len(samples)} requests need more than --max-model-len {limit} tokens "
                          f"(the longest: {worst.prompt_len} in the prompt + {worst.expected_output_len} out): lower "
                          f"their lengths (--input-len / --output-len for random prompts) or raise --max-model-len.")
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=s.expected_output_len, ignore_eos=True)
              for s in samples]
    prompts = [s.prompt for s in samples]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    core = llm.engine.core
    return {
        "elapsed_time": elapsed,
        "num_requests": len(samples),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "num_preemptions": core.counters.num_preemptions,
        "peak_device_memory_bytes": core.worker.device_memory()[1],
    }
