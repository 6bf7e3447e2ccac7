"""Refit calibration files on their own measurements (by default the ones pagedserve ships), as after a
change to the cost model: the device's terms on the timed steps, the host's on the server runs, the way
in as measured. A file timed before calibrate sent a burst of requests gets its ingress spacing from
bursts sent here, on this machine's CPU (the median of three), and a note that says so: the simulated
ladders hardly move with the spacing's size, only with requests sent at once not arriving as one.

Usage: python -m benchmarks.sim.refit [FILE ...]
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from pagedserve.config import EngineArgs
from pagedserve.memory import GiB
from pagedserve.sim.calibrate import burst_spacing
from pagedserve.sim.cost import Calibration, CostModel, shipped
from pagedserve.tune.plan import make_plan

SPACING_NOTE = "ingress spacing timed on another host"


def refit(cal: Calibration) -> Calibration:
    cost, err = CostModel.fit(cal.samples)
    cost = cost.with_launch(cal.samples).with_host(cal.host_samples).with_request_latency(cal.cost.request_latency)
    cost = cost.with_ingress_spacing(cal.cost.ingress_spacing)
    notes = list(cal.notes)
    if not cal.way_in_samples and not any(n.startswith(SPACING_NOTE) for n in notes):
        args = EngineArgs(**cal.engine_args)
        serving = args.create_config(plan_for="cuda", serving=True)
        budget = make_plan(args, gpu_memory_gib=cal.gpu_memory_bytes / GiB).budget
        spacing = statistics.median(burst_spacing(serving, budget, cost, log=lambda _: None)[0] for _ in range(3))
        cost = cost.with_ingress_spacing(spacing)
        host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        notes.append(f"{SPACING_NOTE}: the median of three bursts sent to a server on a CPU machine ({host}), "
                     f"not on the GPU's host")
    return dataclasses.replace(cal, cost=cost, mape=err, notes=notes)


def main(paths: list[str]) -> None:
    for path in paths or sorted(str(p) for p in shipped().values()):
        cal = refit(Calibration.from_json(json.loads(Path(path).read_text())))
        cal.save(path)
        print(f"{path}: {cal.describe()}")


if __name__ == "__main__":
    main(sys.argv[1:])
