"""Argument types the benchmark commands share: a bad value stops the command with a message naming its flag
(argparse), instead of meaning something else or failing later."""

from __future__ import annotations

import argparse


def on_off(value: str) -> list[bool]:
    """A comma-separated list of on/off settings."""
    words = value.split(",")
    if not set(words) <= {"on", "off"}:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a comma-separated list of on and off")
    return [w == "on" for w in words]


def positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive integer")
    return int(value)


def positives(value: str) -> list[int]:
    """A comma-separated list of positive integers."""
    return [positive(v) for v in value.split(",")]
