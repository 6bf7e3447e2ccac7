"""A ladder on the simulator: each rung is ``simulate_load`` on the engine that ``pagedserve serve`` would
start with the sweep's flags, on the GPU a calibration was measured on."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from pagedserve.bench.datasets import SampleRequest
from pagedserve.errors import ConfigError
from pagedserve.memory import GiB, dtype_name
from pagedserve.sim.cost import Calibration, load_calibration
from pagedserve.sim.load import simulate_load


@dataclasses.dataclass
class Simulation:
    calibration: Calibration
    gpu_memory_bytes: int  # the simulated GPU's memory (default: the calibration GPU's)
    source: str            # the file or shipped name it came from

    @classmethod
    def load(cls, name_or_path: str, gpu_memory_gib: float | None = None, gpu: str | None = None) -> "Simulation":
        """A calibration, on a GPU of ``gpu_memory_gib`` GiB, else of preset ``gpu``'s memory, else its own."""
        from pagedserve.tune.plan import GPU_PRESETS

        cal = load_calibration(name_or_path)
        total = int(gpu_memory_gib * GiB) if gpu_memory_gib else GPU_PRESETS[gpu] if gpu else cal.gpu_memory_bytes
        if total <= 0:
            raise ConfigError(f"--simulate {name_or_path}: the calibration records no GPU memory (it was measured on "
                              f"{cal.gpu}); give --gpu-memory GiB.")
        return cls(cal, total, name_or_path)

    def describe(self) -> str:
        return (f"simulated from {self.source}: {self.calibration.describe()}; GPU memory "
                f"{self.gpu_memory_bytes / GiB:.2f} GiB")

    def engine(self, model: str, flags: list[str]):
        """(config, memory budget) of ``pagedserve serve MODEL FLAGS`` on the simulated GPU, as the planner
        estimates it; refused when the calibration was measured on another model or KV-cache dtype."""
        from pagedserve.args import engine_args_from
        from pagedserve.bench.launch import check_serve_flags
        from pagedserve.tune.plan import make_plan

        args = engine_args_from(check_serve_flags(model, flags))
        if args.tensor_parallel_size != 1:
            raise ConfigError("--tensor-parallel-size: the simulator models one GPU.")
        config = args.create_config(plan_for="cuda", serving=True)
        cal = self.calibration
        kv = dtype_name(config.kv_dtype)
        if args.model != cal.model or kv != cal.kv_cache_dtype:
            raise ConfigError(f"--simulate {self.source} was measured with {cal.model} and a {cal.kv_cache_dtype} KV "
                              f"cache; this ladder runs {model} with a {kv} KV cache. Use a calibration of that "
                              f"pair: `pagedserve calibrate {model} --load-format dummy "
                              f"--kv-cache-dtype {args.kv_cache_dtype} --output FILE` on the GPU.")
        plan = make_plan(args, gpu_memory_gib=self.gpu_memory_bytes / GiB)
        if plan.failures:
            raise ConfigError(f"The simulated server would not start: {plan.failures[0]}")
        return config, plan.budget

    def ladder(self, model: str, flags: list[str], plan, draw: Callable[[int, int], list[SampleRequest]],
               seed: int, burstiness: float, goodput: dict[str, float]) -> Callable[[int, float], dict]:
        """``measure(index, load)`` for ``bench.sweep.run_ladder``: the rung's prompts (as ``run_rung``
        draws them) through a fresh simulated engine, closed loop at C or open loop at a rate."""
        from pagedserve.bench.sweep import aggregate, rung_seeds

        config, budget = self.engine(model, flags)
        vocab = config.model.vocab_size

        def measure(index: int, load: float) -> dict:
            closed = plan.mode == "concurrency"
            arrivals, prompts = rung_seeds(seed, index)
            runs = []
            for rep in range(plan.repeats):
                samples = [as_token_ids(s, vocab, prompts + rep + k)
                           for k, s in enumerate(draw(plan.prompts(load), prompts + rep))]
                runs.append(simulate_load(config, budget, self.calibration.cost, samples,
                                          max_concurrency=int(load) if closed else None,
                                          request_rate=math.inf if closed else load, burstiness=burstiness,
                                          seed=arrivals, goodput=goodput))
            rung = aggregate(runs)
            rung.update(load=load, prefix_cache="simulated", simulated=True)
            return rung

        return measure


def as_token_ids(s: SampleRequest, vocab: int, seed: int) -> SampleRequest:
    """A text prompt as random token ids of its length (the simulator needs lengths, not words; a text
    dataset's shared prefixes are not kept)."""
    if not isinstance(s.prompt, str):
        return s
    ids = np.random.default_rng(seed).integers(0, vocab, s.prompt_len).tolist()
    return SampleRequest(ids, s.prompt_len, s.expected_output_len)
