"""What every route shares: the engine, the settings, the metrics, and request admission."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagedserve.outputs import RequestOutput
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.server.errors import APIError, unavailable
from pagedserve.server.metrics import ServerMetrics


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_num_queued_reqs: int | None = None
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0  # seconds between stats log lines; 0: off


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.served = settings.served_model_names
        self.metrics = ServerMetrics(engine, self.served[0])
        engine.observer = self.metrics

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.served:
            raise APIError(400, f"The model `{name}` does not exist. Served: {', '.join(self.served)}.",
                           "NotFoundError", "model")
        return name or self.served[0]

    def admit(self, n: int) -> None:
        limit = self.settings.max_num_queued_reqs
        if limit is not None and self.engine.num_in_flight + n > limit:
            self.metrics.rejected += n
            raise unavailable(f"The server is at its limit of {limit} requests in flight "
                              f"(--max-num-queued-reqs); retry later.")
        if self.engine.dead is not None:
            raise EngineDeadError(f"The engine stopped: {self.engine.dead!r}")

    def start(self, base_id: str, prompts: list, params) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt before starting any, so a bad one rejects the whole call cleanly."""
        made = [self.engine.inputs.make_request(f"{base_id}-{i}", p, dataclasses.replace(params))
                for i, p in enumerate(prompts)]
        self.admit(len(made))
        return [self.engine.add(req, text) for req, text in made]


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state ``build_app`` attached to the app."""
    return request.app.state.server
