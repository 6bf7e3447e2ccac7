"""User-facing errors: a configuration the engine cannot run, a request it cannot take, a request that failed
while running, and a benchmark that could not run against its server."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def option(name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``: the command-line flag of a setting, as messages name it."""
    return "--" + name.replace("_", "-")


class ConfigError(ValueError):
    """A configuration the engine cannot run; the message names the flag to change."""


class InvalidRequestError(ValueError):
    """A request that cannot be served as asked; ``param`` names the offending field (the server puts it
    in the OpenAI error JSON and answers 400)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class BenchmarkError(RuntimeError):
    """A load test that could not run (its server refused every warm-up request, or went away); the
    message says what was seen and where partial results are."""


class RequestFailedError(RuntimeError):
    """One request failed while it ran (its step raised, or its output could not be processed); the others
    go on. The server answers it with an error (an in-stream error frame once streaming has started)."""


@contextlib.contextmanager
def reported(prog: str) -> Iterator[None]:
    """A command's body whose user-facing errors end it with ``PROG: error: MESSAGE`` on stderr, not a traceback:
    exit status 2 for a configuration or request (as argparse's own), 1 for a load test that could not run; 130 on
    Ctrl-C."""
    try:
        yield
    except (ConfigError, InvalidRequestError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except BenchmarkError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
