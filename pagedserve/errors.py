"""User-facing errors: a configuration the engine cannot run, a request it cannot take, and a benchmark that
could not run against its server."""


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
