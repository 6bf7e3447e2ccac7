"""The output tokens a second the server's own host work allows: a real server (uvicorn on loopback) over a
worker whose steps cost nothing, driven by `bench serve` in its own process at a few levels of requests in
flight. Everything measured is Python: the HTTP layer, streaming, detokenizing, scheduling, step arrays.
Where the device's step is shorter than this host time a step, the host bounds the server. The server's
CPU time a token (all its threads; the client is another process) is the steadier figure; on Linux, how it
splits between the event loop's thread (HTTP, streaming, detokenizing) and the engine thread (scheduling, step
arrays) says which of the two a change should go after. Each level runs on a server of its own.

python -m benchmarks.serving.host_ceiling [--model Qwen/Qwen3-0.6B] [--in-flight 16,64] [--repeats 3]
    [--stream-interval N]
(CPU is enough; the client shares the machine's cores with the server, so compare runs on one machine)
--profile: one run per level under yappi (pip install yappi), then the functions where the server's
threads spent their own CPU time, most first: where a host optimization would pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading

import numpy as np

from benchmarks.args import run_main
from pagedserve.config import EngineArgs
from pagedserve.model.worker import Worker
from pagedserve.sim.calibrate import FREE_STEPS, bench_server


def thread_cpu(names: tuple[str, ...]) -> dict[str, float] | None:
    """CPU seconds so far of this process's threads of those names (Linux /proc; None elsewhere)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for t in threading.enumerate():
        if t.name in names:
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                return None
            out[t.name] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out if len(out) == len(names) else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--in-flight", default="16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream-interval", type=int, default=1, help="The server's --stream-interval.")
    p.add_argument("--profile", action="store_true", help="Profile the server's threads (needs yappi).")
    ns = p.parse_args()
    if ns.profile:
        import yappi  # a profiler of every thread: the event loop's and the engine core's

        yappi.set_clock_type("cpu")
        yappi.start()
        ns.repeats = 1
    args = EngineArgs(model=ns.model, load_format="dummy", max_model_len=2048, max_num_seqs=256,
                      kv_cache_memory="2GiB", device="cpu")
    worker = Worker(args.create_config())  # only for its memory budget, which the priced worker reports
    # a cache that holds max-num-seqs requests of max-model-len: the levels are bounded by requests in flight only
    # (the priced worker allocates none of it)
    blocks = args.max_num_seqs * -(-args.max_model_len // worker.budget.block_size)
    budget = dataclasses.replace(worker.budget, num_blocks=blocks,
                                 kv_cache_bytes=blocks * worker.budget.bytes_per_block)
    worker.shutdown()
    levels = [int(c) for c in ns.in_flight.split(",")]
    rates: dict[int, list[float]] = {c: [] for c in levels}
    steps: dict[int, list[float]] = {c: [] for c in levels}
    cpu: dict[int, list[float]] = {c: [] for c in levels}
    loop_share: dict[int, list[float]] = {c: [] for c in levels}
    threads = ("http-server", "engine-core")
    for _ in range(ns.repeats):
        for c in levels:
            seen: list[dict[str, float] | None] = []  # the threads' CPU as the level ends, its server still up
            for run in bench_server(args.create_config(serving=True), budget, FREE_STEPS, [c],
                                    log=lambda *a: seen.append(thread_cpu(threads)),
                                    flags=("--stream-interval", str(ns.stream_interval))):
                rates[c].append(run["seqs"] / run["seconds"])
                steps[c].append(run["seqs"])
                cpu[c].append(run["cpu_per_token"] * 1e6)
                if seen[-1] is not None:
                    loop, engine = seen[-1]["http-server"], seen[-1]["engine-core"]
                    loop_share[c].append(100 * loop / (loop + engine))
    print(f"{'in flight':>9}  {'requests a step':>15}  {'output tok/s (median, min-max)':>32}  "
          f"{'server CPU µs a token':>22}  {'event loop / engine thread':>26}")
    for c in levels:
        r, share = rates[c], np.median(loop_share[c]) if loop_share[c] else None
        split = f"{share:.0f} % / {100 - share:.0f} %" if share is not None else "-"
        print(f"{c:>9}  {np.median(steps[c]):>15.1f}  {np.median(r):>14,.0f} ({min(r):,.0f}-{max(r):,.0f})  "
              f"{np.median(cpu[c]):>22.1f}  {split:>26}")
    if ns.profile:
        import yappi

        yappi.stop()
        stats = sorted(yappi.get_func_stats(), key=lambda s: -s.tsub)
        total = sum(s.tsub for s in stats)
        print(f"\nown CPU time by function, all levels ({total:.2f} s, the server's threads and the process's):")
        for s in stats[:25]:
            where = s.module.split("site-packages/")[-1].split("pagedserve/")[-1]
            print(f"{100 * s.tsub / total:5.1f} %  {s.ncall:>9,}  {where}:{s.name}")


if __name__ == "__main__":
    run_main(main)
