"""The two kinds of user error: a configuration the engine cannot run, and a request it cannot take."""


class ConfigError(ValueError):
    """A configuration the engine cannot run; the message names the flag to change."""


class InvalidRequestError(ValueError):
    """A request that cannot be served as asked; ``param`` names the offending field (the server puts it
    in the OpenAI error JSON and answers 400)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
