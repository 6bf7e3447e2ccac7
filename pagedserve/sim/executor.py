"""A worker that runs no model: it prices each step with a cost model and returns placeholder tokens, so
the engine's own scheduler, block pool and core run unchanged on a virtual clock."""

from __future__ import annotations

from pagedserve.memory import MemoryBudget
from pagedserve.model.step import SamplingInputs, StepInputs
from pagedserve.sim.cost import CostModel, graph_caps, step_features, step_kind


class _Samples:
    """A launched step's tokens: one placeholder id per sampling row (requests run with ignore_eos)."""

    def __init__(self, rows: int):
        self.rows = rows

    def wait(self) -> tuple[list[int], None, None, None]:
        return [0] * self.rows, None, None, None


class SimulatedWorker:
    def __init__(self, config, budget: MemoryBudget, cost: CostModel):
        self.budget, self.cost = budget, cost
        self.caps = graph_caps(config)
        self.launched: list[float] = []  # seconds of each step launched since the caller last took them
        # what the device would hold: the budget (weights, activations, the preallocated cache)
        self._memory = budget.weights + budget.activation_peak + budget.non_torch + budget.kv_cache_bytes

    def execute(self, inp: StepInputs, sampling: SamplingInputs | None) -> _Samples | None:
        # the host's work for a step overlaps the device's (one step in flight): the longer of the two counts
        device = self.cost.seconds(*step_features(inp), step_kind(inp, self.caps))
        self.launched.append(max(device, self.cost.host_seconds(len(inp.query_lens))))
        return _Samples(len(inp.sample_rows)) if len(inp.sample_rows) else None

    def device_memory(self) -> tuple[int, int]:
        return self._memory, self._memory

    def reset_peak_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
