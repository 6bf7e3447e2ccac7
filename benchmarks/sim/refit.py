"""Refit calibration files on their own measurements (by default the ones pagedserve ships), as after a
change to the cost model: the device's terms on the timed steps, the host's on the server runs, the way
in as measured. A file timed before calibrate measured the way in beyond one request's latency gets its
ingress spacing and delivery jitter from runs here, on this machine's CPU (the median of three), and a
note that says so.

Usage: python -m benchmarks.sim.refit [FILE_OR_SHIPPED_NAME ...]
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
from pathlib import Path

from benchmarks.args import run_main
from pagedserve.args import engine_flags
from pagedserve.config import EngineArgs
from pagedserve.errors import ConfigError
from pagedserve.sim.calibrate import way_in
from pagedserve.model.runner import graph_sizes
from pagedserve.sim.cost import Calibration, CostModel, computed_tokens, load_calibration, shipped
from pagedserve.sim.ladder import Simulation

TIMED_HERE = "ingress spacing and delivery jitter timed on another host"
_WAY_IN = ("ingress_spacing", "delivery_jitter", "delivery_jitter_per_seq")


def refit(cal: Calibration, source: str) -> Calibration:
    # the tokens each step computed, from the graph sizes of the engine that timed it
    sizes = graph_sizes(EngineArgs(**cal.engine_args).create_config(plan_for="cuda"))
    samples = [{**s, "computed": computed_tokens(s["tokens"], s["kind"], not s["prefill_work"], sizes)}
               for s in cal.samples]
    cost, err = CostModel.fit_steps(samples, cal.host_samples)
    cost = cost.with_request_latency(cal.cost.request_latency)
    cost = dataclasses.replace(cost, **{k: getattr(cal.cost, k) for k in _WAY_IN})
    notes = list(cal.notes)
    if not cal.way_in_samples and not any(n.startswith(TIMED_HERE) for n in notes):
        # the serving engine the calibration's flags give, as a simulated ladder builds it
        flags = engine_flags(EngineArgs(**cal.engine_args))
        serving, budget = Simulation(cal, cal.gpu_memory_bytes, source).engine(cal.model, flags)
        timed = [way_in(serving, budget, cost, log=lambda _: None, keep_latency=True)[0] for _ in range(3)]
        cost = dataclasses.replace(cost, **{k: statistics.median(getattr(t, k) for t in timed) for k in _WAY_IN})
        host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        notes.append(f"{TIMED_HERE}: the median of three runs through a server on a CPU machine ({host}), not "
                     f"on the GPU's host")
    return dataclasses.replace(cal, cost=cost, mape=err, samples=samples, notes=notes)


def main(names: list[str]) -> None:
    known = shipped()
    for name in names or sorted(known):
        if name not in known and not Path(name).is_file():
            raise ConfigError(f"{name!r} is neither a calibration file nor one of the shipped ones "
                              f"({', '.join(sorted(known))}).")
        cal = refit(load_calibration(name), name)
        path = known.get(name, name)
        cal.save(path)
        print(f"{path}: {cal.describe()}")


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
