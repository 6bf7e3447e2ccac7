"""Host time of a step, which must stay below the GPU's for the one step in flight to hide it: turning a
decode step into arrays (the engine's StepBuilder), the mixed-step bound's check of the prompt backlog
(``serve``'s default bound), then every phase of whole engine steps at 512 running requests (scheduling,
inputs and sampling parameters, the update, the frontend).

python -m benchmarks.engine.host_prepare   (CPU is enough: it times Python and numpy only)
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np


from pagedserve import LLM, SamplingParams
from pagedserve.engine.block_pool import BlockPool
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.step_builder import StepBuilder


def main() -> None:
    builder = StepBuilder(block_size=16, vocab_size=512, seed=0)
    for n in (1, 64, 256):
        pool = BlockPool(40000, 16, 128, enable_prefix_caching=False)
        sched = Scheduler(pool, 256, 65536, 2048, True, max_mixed_prefill_tokens=256)
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
            builder.build(out, pool)
        arrays = (time.perf_counter() - t0) / 200
        t0 = time.perf_counter()
        for _ in range(200):
            sched._holds_prompts_down()
        bound = (time.perf_counter() - t0) / 200
        print(f"{n:4d} decodes at context ~1200: step arrays {arrays * 1e3:.3f} ms, the bound's backlog check "
              f"{bound * 1e6:.1f} us per step")


def engine_steps(n: int = 512, steps: int = 100) -> None:
    """Decode steps of ``n`` requests on the tiny model (temperature 0.6, as the throughput benchmark
    samples), each host phase timed by wrapping it; the model's forward and the CPU sampler are the
    device's work on a GPU, so they are reported but not counted as host time."""
    import pagedserve.model.runner as runner_mod
    from pagedserve.outputs import RequestOutputKind

    llm = LLM("tiny", max_model_len=2048, max_num_seqs=n, max_num_batched_tokens=16384, enforce_eager=True)
    engine, times = llm.engine, defaultdict(float)

    def timed(owner, name, key):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[key] += time.perf_counter() - t0
        setattr(owner, name, wrapper)

    core = engine.core
    runner = core.worker.runner
    for owner, name, key in ((core.scheduler, "schedule", "schedule"), (core.builder, "build", "inputs + sampling"),
                             (runner, "sampling_batch", "sampling upload"),
                             (core.scheduler, "update_from_output", "update"), (engine.outputs, "process", "frontend"),
                             (runner, "forward", "device: model (CPU)"), (runner_mod, "sample", "device: sampler (CPU)")):
        timed(owner, name, key)
    rng = np.random.default_rng(0)
    for i in range(n):
        engine.add_request(str(i), rng.integers(0, 200, 64).tolist(),
                           SamplingParams(temperature=0.6, max_tokens=steps + 40, ignore_eos=True),
                           RequestOutputKind.FINAL_ONLY)
    for _ in range(20):  # past the prefills
        engine.step()
    assert core.last_stats.num_decode_tokens == n and core.last_stats.num_prefill_tokens == 0
    times.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = (time.perf_counter() - t0) / steps * 1e3
    print(f"\n{n} decodes a step, tiny model, mean of {steps} steps:")
    for key, t in times.items():
        print(f"  {key:<24} {t / steps * 1e3:7.3f} ms")
    device = sum(t for key, t in times.items() if key.startswith("device")) / steps * 1e3
    print(f"host per step: {total - device:.2f} ms (the step {total:.2f} ms less the device's work)")


if __name__ == "__main__":
    main()
    engine_steps()
