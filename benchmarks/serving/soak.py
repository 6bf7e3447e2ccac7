"""A long soak and an overload against a real server: does anything leak, hang or fail over many requests
with clients that misbehave, and does 10x the capacity shed cleanly?

Phase 1: --requests requests at --concurrency, completions, chat and Responses, streamed and not; every tenth stream
is cut by its client after a few chunks, every twentieth non-streaming request gives up after 50 ms.
Afterwards the server must hold nothing: no request running, waiting or in flight, no KV block in use.
Resident memory is sampled throughout (it should level off, not climb).
Phase 2: 10 x --max-num-queued-reqs requests at once: 503s with Retry-After for the excess, every admitted
request complete, and how long until a new request is served again.

python -m benchmarks.serving.soak --requests 20000 --concurrency 64 --result-dir results/soak
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.args import run_main, server_flags
from pagedserve.bench.launch import LocalServer
from pagedserve.bench.metrics import scrape

GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "pagedserve:num_requests_in_flight": "in_flight", "vllm:kv_cache_usage_perc": "kv_usage",
          "pagedserve:device_memory_used_bytes": "memory"}


async def gauges(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/metrics") as r:
        return scrape(await r.text(), GAUGES)[0]


async def one(session: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> tuple[str, float]:
    api, stream = rng.choices(["completions", "chat", "responses"], [5, 3, 2])[0], rng.random() < 0.5
    prompt_len, max_tokens = rng.randint(4, 200), rng.randint(1, 64)
    words = " ".join(f"w{rng.randint(0, 99)}" for _ in range(prompt_len))
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": words}]
    elif api == "responses":
        body = {"input": words, "max_output_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    else:
        body["prompt"] = [rng.randint(3, 255) for _ in range(prompt_len)]
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}[api]
    t0 = time.perf_counter()
    try:
        if stream:
            async with session.post(url + path, json=body) as r:
                chunks = 0
                async for line in r.content:
                    chunks += line.startswith(b"data: {")
                    if i % 10 == 0 and chunks == 3:
                        return "cut by client", time.perf_counter() - t0
                return str(r.status), time.perf_counter() - t0
        timeout = aiohttp.ClientTimeout(total=0.05 if i % 20 == 0 else 300)
        async with session.post(url + path, json=body, timeout=timeout) as r:
            await r.read()
            return str(r.status), time.perf_counter() - t0
    except asyncio.TimeoutError:
        return "client timeout", time.perf_counter() - t0


async def soak(url: str, n: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes, latencies, memory = Counter(), [], []
    sem = asyncio.Semaphore(concurrency)
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def bounded(i: int) -> None:
            nonlocal done
            async with sem:
                outcome, latency = await one(session, url, i, rng)
            outcomes[outcome] += 1
            if outcome == "200":
                latencies.append(latency)
            done += 1

        async def sample() -> None:
            t0 = time.perf_counter()
            while done < n:
                memory.append((time.perf_counter() - t0, (await gauges(session, url)).get("memory")))
                await asyncio.sleep(5)

        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(bounded(i) for i in range(n)))
        duration = time.perf_counter() - t0
        await sampler
        await asyncio.sleep(1)
        after = await gauges(session, url)
    lat = np.asarray(latencies) * 1000
    mems = [m for _, m in memory if m is not None]
    return {"requests": n, "concurrency": concurrency, "duration_s": duration, "outcomes": dict(outcomes),
            "shed_503": outcomes.get("503", 0),
            "server_errors": sum(v for k, v in outcomes.items() if k.startswith("5") and k != "503"),
            "p50_ms": float(np.median(lat)), "p95_ms": float(np.percentile(lat, 95)),
            "memory_first_gib": mems[0] / 2**30 if mems else None, "memory_last_gib": mems[-1] / 2**30 if mems else None,
            "memory_peak_gib": max(mems) / 2**30 if mems else None, "memory_samples": memory, "after": after}


async def overload(url: str, n: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int):
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", json={"prompt": [5 + i % 200] * 64, "max_tokens": 32,
                                                                    "ignore_eos": True}) as r:
                body = await r.json()
                return r.status, r.headers.get("retry-after"), time.perf_counter() - t0, body

        results = await asyncio.gather(*(one(i) for i in range(n)))
        t_end = time.perf_counter()
        while True:  # recovery: the first request served after the burst
            async with session.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}) as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        recovery = time.perf_counter() - t_end
    admitted = [r for r in results if r[0] == 200]
    shed = [r for r in results if r[0] == 503]
    return {"requests": n, "admitted": len(admitted), "shed_503": len(shed),
            "other": dict(Counter(r[0] for r in results if r[0] not in (200, 503))),
            "shed_with_retry_after": sum(1 for r in shed if r[1]),
            "admitted_complete": sum(1 for r in admitted if r[3]["usage"]["completion_tokens"] == 32),
            "admitted_p95_ms": float(np.percentile([r[2] for r in admitted], 95)) * 1000 if admitted else None,
            "shed_max_ms": max((r[2] for r in shed), default=0.0) * 1000, "recovery_s": recovery}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--serve-args", default="--kv-cache-memory 64MiB --max-model-len 1024")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-num-queued-reqs", type=int, default=32, help="The server's limit for the overload phase "
                    "(the soak's server admits twice --concurrency).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default="results/soak")
    ns = ap.parse_args()
    serve_args = server_flags(ap, ns.model, ns.serve_args)
    folder = Path(ns.result_dir)
    # room at the entrance: a client that cuts a stream sends its next request before the server has seen
    # the disconnect, so a limit equal to the concurrency would shed some of the soak's requests
    flags = [*serve_args, "--max-num-queued-reqs", str(2 * ns.concurrency)]
    with LocalServer(ns.model, flags, folder / "server-soak.log") as server:
        print(f"soak: {' '.join(server.command)}", flush=True)
        soak_result = asyncio.run(soak(server.base_url, ns.requests, ns.concurrency, ns.seed))
    soak_result["server_exit_code"] = server.exit_code
    flags = [*serve_args, "--max-num-queued-reqs", str(ns.max_num_queued_reqs)]
    with LocalServer(ns.model, flags, folder / "server-overload.log") as server:
        print(f"overload: {' '.join(server.command)}", flush=True)
        over = asyncio.run(overload(server.base_url, 10 * ns.max_num_queued_reqs))
    over["server_exit_code"] = server.exit_code
    (folder / "soak.json").write_text(json.dumps({"args": vars(ns), "soak": soak_result, "overload": over}, indent=2))
    s = soak_result
    print(f"soak: {s['requests']} requests at concurrency {s['concurrency']} in {s['duration_s']:.0f} s; outcomes "
          f"{s['outcomes']}; server errors (5xx but 503) {s['server_errors']}, shed (503) {s['shed_503']}; "
          f"p50/p95 {s['p50_ms']:.0f}/{s['p95_ms']:.0f} ms")
    print(f"  memory first/peak/last {s['memory_first_gib']:.2f}/{s['memory_peak_gib']:.2f}/{s['memory_last_gib']:.2f} "
          f"GiB; afterwards {s['after']}; server exit {s['server_exit_code']}")
    print(f"overload: {over['requests']} at once against --max-num-queued-reqs {ns.max_num_queued_reqs}: "
          f"{over['admitted']} admitted ({over['admitted_complete']} complete, p95 {over['admitted_p95_ms']:.0f} ms), "
          f"{over['shed_503']} shed with 503 ({over['shed_with_retry_after']} with Retry-After, slowest "
          f"{over['shed_max_ms']:.0f} ms), other {over['other']}; recovered in {over['recovery_s']:.2f} s; "
          f"server exit {over['server_exit_code']}")


if __name__ == "__main__":
    run_main(main)
