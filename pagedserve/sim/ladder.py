"""A ladder on the simulator: each rung is ``simulate_load`` on the engine that ``pagedserve serve`` would
start with the sweep's flags, on the GPU a calibration was measured on."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable

import numpy as np

from pagedserve.bench.datasets import SampleRequest
from pagedserve.errors import ConfigError
from pagedserve.memory import GiB, dtype_name
from pagedserve.sim.cost import Calibration, load_calibration, shipped
from pagedserve.sim.load import simulate_load

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Simulation:
    calibration: Calibration  # its cost model scaled to the simulated GPU when that is another one
    gpu_memory_bytes: int  # the simulated GPU's memory (default: the calibration GPU's)
    source: str            # the file or shipped name it came from
    gpu: str = ""          # the simulated GPU, as shown to the operator
    scaled: str = ""       # how the step costs were carried over to another GPU ("" when measured on it)
    unmeasured: str = ""   # the server's steps that the calibration did not time as it runs them ("" when none)

    @classmethod
    def load(cls, name_or_path: str, gpu_memory_gib: float | None = None, gpu: str | None = None) -> "Simulation":
        """A calibration, on a GPU of ``gpu_memory_gib`` GiB, else of preset ``gpu``'s memory, else its own.
        A preset of another GPU than the calibration's also scales its step costs by their peaks' ratios."""
        from pagedserve.tune.plan import FP8_KV_GPUS, GPU_PEAKS, gpu_total_memory

        given = gpu_total_memory(gpu, gpu_memory_gib)
        cal = load_calibration(name_or_path)
        total = cal.gpu_memory_bytes if given is None else given
        if total <= 0:
            raise ConfigError(f"--simulate {name_or_path}: the calibration records no GPU memory (it was measured on "
                              f"{cal.gpu}); give --gpu-memory GiB.")
        measured_on = preset_of(cal.gpu, cal.gpu_memory_bytes)
        if gpu is None or gpu == measured_on:
            return cls(cal, total, name_or_path, cal.gpu)
        if measured_on is None:
            raise ConfigError(f"--gpu {gpu}: {name_or_path} was measured on {cal.gpu}, whose peaks this simulator "
                              f"does not know, so its step times cannot be carried over. Give --gpu-memory GiB "
                              f"to change the memory alone, or run `pagedserve calibrate` on the {gpu}.")
        if cal.kv_cache_dtype.startswith("float8") and gpu not in FP8_KV_GPUS:
            raise ConfigError(f"--gpu {gpu}: the fp8 KV cache needs an Ada or Hopper GPU; simulate a 16-bit cache "
                              f"calibration on it instead.")
        (flops, bytes_s), (flops0, bytes_s0) = GPU_PEAKS[gpu], GPU_PEAKS[measured_on]
        compute, bandwidth = flops / flops0, bytes_s / bytes_s0
        cost = cal.cost.on_faster_gpu(compute, bandwidth)
        scaled = (f"step times scaled from the {measured_on} to the {gpu} by spec-sheet peaks (compute "
                  f"x{compute:.2f}, memory bandwidth x{bandwidth:.2f}): an estimate, as the fractions of the peaks "
                  f"each GPU reaches differ; `pagedserve calibrate` on the {gpu} measures them")
        estimated = dataclasses.replace(cal, cost=cost, gpu=f"{gpu} (estimated from {cal.gpu})")
        return cls(estimated, total, name_or_path, f"{gpu} (estimated)", scaled)

    def describe(self) -> str:
        caveats = "".join(f"; {c}" for c in (self.scaled, self.unmeasured) if c)
        return (f"simulated from {self.source}: {self.calibration.describe()}; GPU memory "
                f"{self.gpu_memory_bytes / GiB:.2f} GiB{caveats}")

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
            fits = [name for name in sorted(shipped())
                    if (c := load_calibration(name)).model == args.model and c.kv_cache_dtype == kv]
            raise ConfigError(f"--simulate {self.source} was measured with {cal.model} and a {cal.kv_cache_dtype} KV "
                              f"cache; this ladder runs {model} with a {kv} KV cache. Use a calibration of that "
                              f"pair: {'shipped, ' + ', '.join(fits) + '; or ' if fits else ''}`pagedserve calibrate "
                              f"{model} --load-format dummy --kv-cache-dtype {args.kv_cache_dtype} --output FILE` on "
                              f"the GPU.")
        plan = make_plan(args, gpu_memory_gib=self.gpu_memory_bytes / GiB)
        if plan.failures:
            raise ConfigError(f"The simulated server would not start: {plan.failures[0]}")
        self._tell_graphs(config)
        return dataclasses.replace(config, max_model_len=plan.max_model_len), plan.budget  # --max-model-len auto

    def _tell_graphs(self, config) -> None:
        """Warn, and say in the artefacts (``describe``), where this server replays prompt steps as graphs that the
        calibration timed launched kernel by kernel: they are priced on its fitted line, no such replay measured."""
        from pagedserve.model.runner import graph_sizes

        launched, prompt_graphs = self.calibration.first_launched_prompt_step(), graph_sizes(config)[1]
        if self.unmeasured or launched is None or not prompt_graphs or prompt_graphs[-1] < launched:
            return
        self.unmeasured = (f"{self.source} timed prompt steps of {launched:,} tokens and more launched kernel by "
                           f"kernel (its engine captured smaller graphs); this server replays them as CUDA graphs up "
                           f"to {prompt_graphs[-1]:,} tokens, which are priced on the fitted line, not measured. "
                           f"`pagedserve calibrate {self.calibration.model}` with this server's "
                           f"--max-cudagraph-capture-size times them")
        logger.warning("%s.", self.unmeasured)

    def ladder(self, model: str, flags: list[str], plan, draw: Callable[[int, int], list[SampleRequest]],
               seed: int, burstiness: float, goodput: dict[str, float],
               replay_for: Callable | None = None) -> Callable[[int, float], dict]:
        """``measure(index, load)`` for ``bench.sweep.run_ladder``: the rung's prompts (as ``run_rung``
        draws them) through a fresh simulated engine, closed loop at C, open loop at a rate, or a recording
        replayed at a speed (``replay_for(n, speed)``: its requests and when to send them)."""
        from pagedserve.bench.sweep import aggregate, rung_seeds

        config, budget = self.engine(model, flags)
        for line in budget.report_lines():  # every rung's fresh engine has this budget
            logger.info(line)
        vocab = config.model.vocab_size

        def measure(index: int, load: float) -> dict:
            closed = plan.mode == "concurrency"
            arrivals, prompts = rung_seeds(seed, index)
            runs = []
            for rep in range(plan.repeats):
                sends = None
                if plan.mode == "replay":
                    drawn, sends = replay_for(plan.prompts(load), load)
                else:
                    drawn = draw(plan.prompts(load), prompts + rep)
                samples = [as_token_ids(s, vocab, prompts + rep + k) for k, s in enumerate(drawn)]
                runs.append(simulate_load(config, budget, self.calibration.cost, samples,
                                          max_concurrency=int(load) if closed else None,
                                          request_rate=load if plan.mode == "rate" else math.inf,
                                          burstiness=burstiness, seed=arrivals, goodput=goodput, arrivals=sends))
            rung = aggregate(runs)
            rung.update(load=load, prefix_cache="simulated", simulated=True)
            return rung

        return measure


def preset_of(gpu_name: str, memory_bytes: int) -> str | None:
    """The GPU preset a device name (as torch reports it, e.g. "NVIDIA H200") is, the nearest in memory
    among those of its name; None when none matches."""
    from pagedserve.tune.plan import GPU_PRESETS

    names = [p for p in GPU_PRESETS if re.sub(r"-\d+GB$", "", p).replace("-", " ") in gpu_name]
    return min(names, key=lambda p: abs(GPU_PRESETS[p] - memory_bytes), default=None)


def as_token_ids(s: SampleRequest, vocab: int, seed: int) -> SampleRequest:
    """A text prompt as random token ids of its length (the simulator needs lengths, not words; a text
    dataset's shared prefixes are not kept)."""
    if not isinstance(s.prompt, str):
        return s
    ids = np.random.default_rng(seed).integers(0, vocab, s.prompt_len).tolist()
    return SampleRequest(ids, s.prompt_len, s.expected_output_len)
