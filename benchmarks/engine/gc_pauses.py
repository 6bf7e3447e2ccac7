"""(CPU) The garbage collector's pauses in a long offline run: every collection of each generation timed
(``gc.callbacks``) while the built-in tiny model serves many long requests, shaped like the 16-bit 8B run
(384 running, ~49k KV blocks). A full collection walks every live container, so what the engine keeps per
request, and how often collections start, decide how long the loop stalls.

python -m benchmarks.engine.gc_pauses [--requests 1000] [--length 1000] [--young-threshold N]

--young-threshold: set the young generation's threshold after the engine's start-up (which raises it to
7,000), e.g. 700 for Python's default.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from benchmarks.args import run_main
from pagedserve.args import positive_int
from pagedserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=1000)
    ap.add_argument("--length", type=positive_int, default=1000, help="prompt and output tokens of each request")
    ap.add_argument("--young-threshold", type=positive_int)
    ns = ap.parse_args()
    llm = LLM("tiny", max_model_len=2 * ns.length + 16, max_num_seqs=384, max_num_batched_tokens=16384,
              num_gpu_blocks_override=49000)
    if ns.young_threshold:
        gc.set_threshold(ns.young_threshold, *gc.get_threshold()[1:])
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 200, ns.length).tolist()} for _ in range(ns.requests)]
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=ns.length, ignore_eos=True, temperature=0.6), use_tqdm=False)
    seconds = time.perf_counter() - t0
    gc.callbacks.remove(timed)
    print(f"{ns.requests} x {ns.length} in / {ns.length} out: {seconds:.1f} s, "
          f"{llm.engine.core.counters.num_steps} steps, young threshold {gc.get_threshold()[0]}")
    for generation, name in enumerate(("young", "middle", "full")):
        ms = np.array(pauses[generation]) * 1e3
        detail = f", median {np.median(ms):.1f} ms, max {ms.max():.1f} ms" if len(ms) else ""
        print(f"  {name:<6} collections: {len(ms):5d}, {ms.sum():6.0f} ms{detail}")


if __name__ == "__main__":
    run_main(main)
