"""``pagedserve serve`` as a child process on a free loopback port, for commands that need a server of
their own (``bench sweep --model``, ``tune``): started, waited for on /health, stopped with SIGTERM. And
``bench serve`` as a child process, for runs that keep the client off the server's interpreter."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pagedserve.errors import ConfigError, option

_RESERVED = ("--host", "--port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags(serve_args: str) -> list[str]:
    """Split ``--serve-args``; refuse what the launcher sets itself, and check the rest with serve's parser
    (a typo fails here, with argparse's message, not minutes later when the server starts)."""
    try:
        flags = shlex.split(serve_args or "")
    except ValueError as e:
        raise ConfigError(f"--serve-args {serve_args!r}: {e}.") from e
    taken = [f for f in flags if f.split("=")[0] in _RESERVED]
    if taken:
        raise ConfigError(f"--serve-args: {', '.join(taken)} is chosen by the launcher (loopback, a free port); "
                          f"leave it out.")
    return flags


def check_serve_flags(model: str, flags: list[str]) -> argparse.Namespace:
    """``pagedserve serve MODEL FLAGS`` parsed by serve's own parser (a wrong flag is named before any
    server starts)."""
    from pagedserve.args import Parser
    from pagedserve.server.cli import add_serve_parser

    parser = Parser(prog="pagedserve")
    add_serve_parser(parser.add_subparsers())
    try:
        return parser.parse_args(["serve", model, *flags])
    except SystemExit as e:  # argparse has printed which flag is wrong
        raise ConfigError(f"--serve-args {' '.join(flags)!r} is not a valid `pagedserve serve` command line "
                          f"(see the message above).") from e


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """``flags`` with ``--name value`` set, replacing any earlier value of it."""
    opt = option(name)
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f == opt:
            skip = True
            continue
        if f.startswith(opt + "="):
            continue
        out.append(f)
    return [*out, opt, value]


def bench_serve(base_url: str, flags: list[str], result: Path) -> dict:
    """Run `pagedserve bench serve FLAGS` against ``base_url`` in its own process; its result JSON, which it
    writes to ``result``."""
    subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--base-url", base_url, *flags,
                    "--disable-tqdm", "--result-dir", str(result.parent), "--result-filename", result.name],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


class LocalServer:
    """A `pagedserve serve` child on 127.0.0.1; its output goes to ``log_path``."""

    def __init__(self, model: str, flags: list[str], log_path: Path, start_timeout: float = 600.0):
        self.model, self.flags, self.log_path = model, flags, Path(log_path)
        self.start_timeout = start_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    @property
    def command(self) -> list[str]:
        return ["pagedserve", "serve", self.model, *self.flags, "--host", "127.0.0.1", "--port", str(self.port)]

    def __enter__(self) -> "LocalServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *self.command[1:]], env=env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise ConfigError(f"The server exited with status {self.proc.returncode} before it was ready "
                                  f"(a start-up failure). Its log, {self.log_path}, ends with:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"The server did not answer /health within {self.start_timeout:.0f} s "
                                  f"(--server-start-timeout); its log {self.log_path} ends with:\n{self.log_tail()}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains and exits 0), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.exit_code is not None:
            return self.exit_code
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
