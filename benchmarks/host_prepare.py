"""Host time to turn a decode step into arrays (ModelRunner.prepare), which the GPU waits for.

python benchmarks/host_prepare.py   (CPU is enough: it times Python and numpy only)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.block_pool import BlockPool  # noqa: E402
from pagedserve.engine.request import Request  # noqa: E402
from pagedserve.engine.scheduler import Scheduler  # noqa: E402


def main() -> None:
    llm = LLM("tiny", num_gpu_blocks_override=40000, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=65536, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    for n in (1, 64, 256):
        pool = BlockPool(40000, 16, 128, enable_prefix_caching=False)
        sched = Scheduler(pool, 256, 65536, 2048, True)
        for i in range(n):  # prompts of 1199 tokens: 75 blocks each
            sched.add_request(Request(str(i), list(range(1, 1200)), SamplingParams(max_tokens=500, ignore_eos=True),
                                      (), 500))
        while True:  # run until every request decodes
            out = sched.schedule()
            if len(out.scheduled) == n and all(s.num_tokens == 1 for s in out.scheduled):
                break
            sched.update_from_output(out, [1] * sum(s.samples for s in out.scheduled))
        t0 = time.perf_counter()
        for _ in range(200):
            runner.prepare(out, pool)
        print(f"{n:4d} decodes at context ~1200: prepare {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
