"""The reference online test's server on this machine's CPU, over a worker that prices each step by a
calibration and sleeps that long (as a thread waiting on a GPU does): everything real but the device —
HTTP, streaming, scheduling, the engine loop, `bench serve` in its own process. What the server's host
side does to the inter-token latency's tail shows here without a GPU; the simulator's figures for the same
run (a virtual clock: no host effects beyond the calibration's terms) come from `pagedserve bench sweep
--model Qwen/Qwen3-8B --serve-args "..." --random-input-len 1024 --random-output-len 256 --request-rate 8
--prompts-per-rung 128 --no-warmup --simulate h200-qwen3-8b-bf16`.

python -m benchmarks.serving.paced_online [--simulate h200-qwen3-8b-bf16] [--serve-args ...] [--bench-flags ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.args import run_main
from benchmarks.engine.online_serve import BENCH_FLAGS, PERCENTILE_FLAGS, SERVER_FLAGS, report
from pagedserve.bench.launch import bench_serve, serve_flags
from pagedserve.sim.calibrate import paced_server
from pagedserve.sim.ladder import Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", default="h200-qwen3-8b-bf16", help="A calibration file or a shipped one's name.")
    ap.add_argument("--serve-args", "--server-flags", default=SERVER_FLAGS,
                    help="The server's flags, one string (--server-flags: an older name).")
    ap.add_argument("--bench-flags", default=BENCH_FLAGS)
    ns = ap.parse_args()
    sim = Simulation.load(ns.simulate)
    model = sim.calibration.model
    # the engine checks the flags as `pagedserve serve` would, and against the calibration
    config, budget = sim.engine(model, ["--load-format", "dummy", *serve_flags(ns.serve_args)])
    with paced_server(config, budget, sim.calibration.cost, "--log-level", "warning") as (url, _), \
            tempfile.TemporaryDirectory() as tmp:
        result = bench_serve(url, [*ns.bench_flags.split(), *PERCENTILE_FLAGS], Path(tmp) / "run.json")
    print(f"{model} on {sim.calibration.gpu}, paced by {ns.simulate}; the server's host work on this machine:")
    report(result)


if __name__ == "__main__":
    run_main(main)
