"""A burst of long prompts against a server with degradation profiles: does it switch to protect, shed the
burst with 503s, keep the steady traffic's TTFT, and return to normal?

Starts `pagedserve serve MODEL SERVE_ARGS --profiles FILE`, runs steady traffic at --concurrency for the
whole run (clients that get a 503 wait a second, as Retry-After asks), fires --burst-prompts prompts of --burst-input-len tokens at once after --before seconds, and
polls GET /admin/profile throughout. Reports the p95 TTFT of the steady requests before the switch to
protect, during protect, and after the return to normal, the 503s, and when the switches happened.

--recovery-dwell-s / --recovery-hold-s shorten the profile's recovery (written to a copy of the file) so a
run sees the return to normal in a minute; the triggers and limits stay as tuned.

python -m benchmarks.serving.profile_burst --model Qwen/Qwen3-8B --serve-args "--load-format dummy ..." \\
    --profiles results/tune/profiles.yaml --input-len 1024 --output-len 256 --burst-input-len 8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from pagedserve.bench.datasets import random_dataset
from benchmarks.args import run_main, server_flags
from pagedserve.bench.launch import LocalServer
from pagedserve.bench.serve import TIMEOUT, BenchConfig, send_request


def p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) * 1000 if values else None


async def run(ns: argparse.Namespace, base_url: str) -> dict:
    cfg = BenchConfig(base_url=base_url, endpoint="/v1/completions", model=ns.model, ignore_eos=True)
    # a fresh prompt for every steady request (a repeated one would be a prefix-cache hit)
    steady = (random_dataset(1, ns.input_len, ns.output_len, seed=10_000 + i)[0] for i in itertools.count())
    burst = random_dataset(ns.burst_prompts, ns.burst_input_len, ns.burst_output_len, seed=2)
    timeline: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    stop_at = t0 + ns.before + ns.after
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def poll() -> None:
            while time.perf_counter() < stop_at:
                async with session.get(base_url + "/admin/profile") as r:
                    active = (await r.json())["active"]
                if not timeline or timeline[-1][1] != active:
                    timeline.append((time.perf_counter() - t0, active))
                await asyncio.sleep(0.25)

        steady_results = []

        async def client() -> None:
            while time.perf_counter() < stop_at:
                r = await send_request(session, cfg, next(steady), t0)
                steady_results.append(r)
                if "HTTP 503" in r.error:  # a polite client: back off, as Retry-After asks
                    await asyncio.sleep(1.0)

        async def one_long(i: int, sample):
            await asyncio.sleep(ns.before + ns.burst_seconds * i / max(len(burst), 1))
            return await send_request(session, cfg, sample, t0)

        async def fire() -> list:
            return await asyncio.gather(*(one_long(i, s) for i, s in enumerate(burst)))

        *_, burst_results = await asyncio.gather(poll(), *(client() for _ in range(ns.concurrency)), fire())
    burst_at = ns.before
    to_protect = next((t for t, a in timeline if a == "protect"), None)
    to_normal = next((t for t, a in timeline if a == "normal" and to_protect is not None and t > to_protect), None)

    def phase(r) -> str:
        if to_protect is None or r.start_time < to_protect:
            return "before"
        return "during" if to_normal is None or r.start_time < to_normal else "after"

    ok = [r for r in steady_results if r.success]
    summary = {
        "burst_sent_at_s": burst_at, "switched_to_protect_at_s": to_protect, "back_to_normal_at_s": to_normal,
        "steady_requests": len(steady_results), "steady_failed": len(steady_results) - len(ok),
        "steady_503": sum("HTTP 503" in r.error for r in steady_results),
        "burst_requests": len(burst_results), "burst_completed": sum(r.success for r in burst_results),
        "burst_503": sum("HTTP 503" in r.error for r in burst_results),
        "burst_other_errors": sorted({r.error[:120] for r in burst_results if r.error and "HTTP 503" not in r.error}),
    }
    for name in ("before", "during", "after"):
        ttfts = [r.ttft for r in ok if phase(r) == name]
        summary[f"steady_{name}_requests"] = len(ttfts)
        summary[f"steady_{name}_p95_ttft_ms"] = p95(ttfts)
        summary[f"steady_{name}_p50_ttft_ms"] = float(np.median(ttfts)) * 1000 if ttfts else None
    return {"summary": summary, "timeline": timeline,
            "steady": [{"start_s": r.start_time, "ttft_s": r.ttft, "error": r.error} for r in steady_results],
            "burst": [{"start_s": r.start_time, "ttft_s": r.ttft, "error": r.error} for r in burst_results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--profiles", required=True)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="Steady requests in flight throughout (default: the normal profile's max_num_seqs).")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--burst-prompts", type=int, default=32)
    ap.add_argument("--burst-input-len", type=int, default=8000)
    ap.add_argument("--burst-output-len", type=int, default=16)
    ap.add_argument("--burst-seconds", type=float, default=5.0, help="The burst's prompts arrive evenly over this.")
    ap.add_argument("--before", type=float, default=20.0, help="Seconds of steady traffic before the burst.")
    ap.add_argument("--after", type=float, default=60.0, help="Seconds of steady traffic after it.")
    ap.add_argument("--recovery-dwell-s", type=float, default=None)
    ap.add_argument("--recovery-hold-s", type=float, default=None)
    ap.add_argument("--result-dir", default="results/burst")
    ns = ap.parse_args()
    serve_args = server_flags(ap, ns.model, ns.serve_args)
    folder = Path(ns.result_dir)
    folder.mkdir(parents=True, exist_ok=True)
    spec = yaml.safe_load(Path(ns.profiles).read_text())
    ns.concurrency = ns.concurrency or spec["profiles"]["normal"]["max_num_seqs"]
    for key, value in (("min_dwell_s", ns.recovery_dwell_s), ("hold_s", ns.recovery_hold_s)):
        if value is not None:
            spec.setdefault("recovery", {})[key] = value
    profiles = folder / "profiles.yaml"
    profiles.write_text(yaml.safe_dump(spec, sort_keys=False))
    flags = [*serve_args, "--profiles", str(profiles)]
    with LocalServer(ns.model, flags, folder / "server.log") as server:
        print(f"server up: {' '.join(server.command)}", flush=True)
        result = asyncio.run(run(ns, server.base_url))
    result["summary"]["server_exit_code"] = server.exit_code
    (folder / "burst.json").write_text(json.dumps({"args": vars(ns), **result}, indent=2))
    s = result["summary"]
    fmt = lambda v: "n/a" if v is None else f"{v:,.1f}"  # noqa: E731
    print(f"burst of {s['burst_requests']} x {ns.burst_input_len} tokens at {s['burst_sent_at_s']:.1f} s: "
          f"{s['burst_completed']} completed, {s['burst_503']} got 503; other errors: {s['burst_other_errors'] or 'none'}")
    print(f"protect at {fmt(s['switched_to_protect_at_s'])} s, normal again at {fmt(s['back_to_normal_at_s'])} s; "
          f"timeline {[(round(t, 1), a) for t, a in result['timeline']]}")
    for name in ("before", "during", "after"):
        print(f"steady traffic {name:>6}: {s[f'steady_{name}_requests']:4d} requests, p50 TTFT "
              f"{fmt(s[f'steady_{name}_p50_ttft_ms'])} ms, p95 TTFT {fmt(s[f'steady_{name}_p95_ttft_ms'])} ms")
    print(f"steady failed: {s['steady_failed']} ({s['steady_503']} with 503); server exit {s['server_exit_code']}")


if __name__ == "__main__":
    run_main(main)
