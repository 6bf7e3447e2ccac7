"""A worker that runs no model: it prices each step with a cost model and returns placeholder tokens, so
the engine's own scheduler, block pool and core run unchanged on a virtual clock."""

from __future__ import annotations

import time

from pagedserve.memory import MemoryBudget
from pagedserve.model.runner import graph_sizes
from pagedserve.model.step import SamplingInputs, StepInputs
from pagedserve.model.worker import freeze_startup_heap
from pagedserve.sim.cost import CostModel, priced_step


class _Samples:
    """A launched step's tokens: one placeholder id per sampling row (requests run with ignore_eos)."""

    def __init__(self, rows: int, ready_at: float | None = None):
        self.rows, self.ready_at = rows, ready_at

    def wait(self) -> tuple[list[int], None, None, None, None]:
        if self.ready_at is not None:  # as a device's step: the thread sleeps, the GIL is free meanwhile
            time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return [0] * self.rows, None, None, None, None


class SimulatedWorker:
    def __init__(self, config, budget: MemoryBudget, cost: CostModel, paced: bool = False):
        """``paced``: each step also takes its priced time on the wall clock, one after another, and start-up
        ends as the real worker's does (its heap frozen for the garbage collector), so a real server around
        the worker runs as it would on that device; else the caller takes the steps' seconds from
        ``launched`` and keeps its own clock."""
        self.config, self.budget, self.cost, self.paced = config, budget, cost, paced
        self.sizes = graph_sizes(config)
        self.launched: list[float] = []  # seconds of each step launched since the caller last took them
        self.device_wait = 0.0           # what the host waits for the device, summed over the steps
        self._free_at = 0.0              # paced: when the step launched last ends
        # what the device would hold: the budget (weights, activations, the preallocated cache)
        self._memory = budget.weights + budget.activation_peak + budget.non_torch + budget.kv_cache_bytes
        if paced:
            freeze_startup_heap()

    def execute(self, inp: StepInputs, sampling: SamplingInputs | None) -> _Samples | None:
        # the host's work for a step overlaps the device's (one step in flight): the longer of the two counts
        kind, features = priced_step(inp, self.sizes)
        device, host = self.cost.step_seconds(features, kind, len(inp.query_lens))
        seconds = max(device, host)
        self.device_wait += seconds - host
        ready_at = None
        if self.paced:
            ready_at = self._free_at = max(time.monotonic(), self._free_at) + seconds
        else:
            self.launched.append(seconds)
        return _Samples(len(inp.sample_rows), ready_at) if len(inp.sample_rows) else None

    def device_memory(self) -> tuple[int, int]:
        return self._memory, self._memory

    def reset_peak_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
