"""Start a real pagedserve server (uvicorn on a free loopback port) for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*flags: str, model: str = "tiny"):
    """Yield (base_url, app) for a server built exactly as `pagedserve serve` builds it."""
    from pagedserve.cli import build_parser
    from pagedserve.server.cli import build_server, serving_in_thread

    port = free_port()
    ns = build_parser().parse_args(["serve", model, "--port", str(port), "--log-level", "warning", *flags])
    server = build_server(ns)
    server.config.app.state.uvicorn = server  # tests that stop it or read its exit code reach it here
    with serving_in_thread(server, start_timeout=60):
        yield f"http://127.0.0.1:{port}", server.config.app


@contextmanager
def serve_process(*flags: str, model: str = "tiny"):
    """Yield (process, base_url) of `pagedserve serve` as its own process, up on /health (for signals and
    exit statuses); killed afterwards if still running."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", model, "--port", str(port), *flags],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(up, timeout=90), proc.stdout.read1().decode() if proc.poll() is not None else "no start"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def metric_values(base_url: str) -> dict[str, float]:
    """Scrape /metrics with prometheus-client's parser: {sample name (+ reason label): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += "{" + sample.labels["finished_reason"] + "}"
            if "le" in sample.labels:
                continue
            values[key] = sample.value
    return values
