"""Argument types and the entry point the benchmark commands share: a bad value stops the command with a message
naming its flag, instead of meaning something else, failing later or ending in a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from pagedserve.args import positive_int
from pagedserve.bench.launch import check_serve_flags, serve_flags
from pagedserve.errors import ConfigError, reported


def on_off(value: str) -> list[bool]:
    """A comma-separated list of on/off settings."""
    words = value.split(",")
    if not set(words) <= {"on", "off"}:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a comma-separated list of on and off")
    return [w == "on" for w in words]


def positives(value: str) -> list[int]:
    """A comma-separated list of positive integers."""
    return [positive_int(v) for v in value.split(",")]


def server_flags(parser: argparse.ArgumentParser, model: str, value: str) -> list[str]:
    """A server's flags as one string, split like a shell and checked by ``pagedserve serve``'s own parser:
    a typo, or a flag the launcher sets itself (``--port``), stops the command before any server starts."""
    try:
        flags = serve_flags(value)
        check_serve_flags(model, flags)
    except ConfigError as e:
        parser.error(str(e))
    return flags


def run_main(main: Callable[[], None]) -> None:
    """A benchmark's entry point: an engine error for a bad flag or request (or a load test that could not run)
    ends it with its message, as ``pagedserve``'s own commands end."""
    with reported(os.path.basename(sys.argv[0])):
        main()
