"""The reference online test's server on this machine's CPU, over a worker that prices each step by a
calibration and sleeps that long (as a thread waiting on a GPU does): everything real but the device —
HTTP, streaming, scheduling, the engine loop, `bench serve` in its own process. What the server's host
side does to the inter-token latency's tail shows here without a GPU; the simulator's figures for the same
run (a virtual clock: no host effects beyond the calibration's terms) come from `pagedserve bench sweep
--model Qwen/Qwen3-8B --serve-args "..." --random-input-len 1024 --random-output-len 256 --request-rate 8
--prompts-per-rung 128 --no-warmup --simulate h200-qwen3-8b-bf16`.

python -m benchmarks.serving.paced_online [--simulate h200-qwen3-8b-bf16] [--server-flags ...] [--bench-flags ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.engine.online_serve import BENCH_FLAGS, PERCENTILE_FLAGS, SERVER_FLAGS, report
from pagedserve.args import Parser
from pagedserve.bench.launch import bench_serve, free_port
from pagedserve.server.cli import add_serve_parser, build_server, serving_in_thread
from pagedserve.sim.executor import SimulatedWorker
from pagedserve.sim.ladder import Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", default="h200-qwen3-8b-bf16", help="A calibration file or a shipped one's name.")
    ap.add_argument("--server-flags", default=SERVER_FLAGS)
    ap.add_argument("--bench-flags", default=BENCH_FLAGS)
    ns = ap.parse_args()
    sim = Simulation.load(ns.simulate)
    model, flags = sim.calibration.model, ["--load-format", "dummy", *ns.server_flags.split()]
    config, budget = sim.engine(model, flags)
    port = free_port()
    parser = Parser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", model, *flags, "--port", str(port), "--disable-log-stats",
                              "--uvicorn-log-level", "warning", "--log-level", "warning"])
    server = build_server(args, worker=SimulatedWorker(config, budget, sim.calibration.cost, paced=True))
    with serving_in_thread(server), tempfile.TemporaryDirectory() as tmp:
        result = bench_serve(f"http://127.0.0.1:{port}", [*ns.bench_flags.split(), *PERCENTILE_FLAGS],
                             Path(tmp) / "run.json")
    print(f"{model} on {sim.calibration.gpu}, paced by {ns.simulate}; the server's host work on this machine:")
    report(result)


if __name__ == "__main__":
    main()
