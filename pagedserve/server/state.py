"""What every route shares: the engine, the settings, the metrics, and request admission."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request

from pagedserve.errors import option
from pagedserve.outputs import RequestOutput
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.server.errors import APIError, unavailable
from pagedserve.server.metrics import LengthRecorder, ServerMetrics
from pagedserve.server.response_store import ResponseStore

INGRESS_LIMITS = ("max_num_queued_reqs", "max_num_queued_tokens", "max_input_tokens", "max_priority")
logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0  # seconds between stats log lines; 0: off
    profiles: object | None = None    # a validated ProfilesFile (pagedserve.tune.profiles)
    trust_request_chat_template: bool = False
    max_request_body_bytes: int = 64 * 2**20
    log_requests: bool = False
    tool_call_parser: str | None = None  # set only with --enable-auto-tool-choice: tool_choice "auto" works
    tools_when_none: bool = True         # not --exclude-tools-when-tool-choice-none
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage names the cached prompt tokens
    record_lengths: str | None = None    # --record-lengths FILE
    max_stored_responses: int = 0        # --max-stored-responses: Responses kept for previous_response_id
    cors: dict | None = None             # CORSMiddleware's arguments (--allowed-origins ...); None: no CORS
    request_id_headers: bool = False     # --enable-request-id-headers
    api_docs: bool = True                # not --disable-fastapi-docs
    tokens_as_ids: bool = False          # --return-tokens-as-token-ids: logprobs name tokens "token_id:N"
    stream_interval: int = 1             # --stream-interval: new tokens a streamed frame waits for


class Admission:
    """The entrance's limits: requests in flight, prompt tokens still waiting, prompt length. With
    degradation profiles the active profile sets them (a limit a profile leaves out falls back to the
    server flag); without, the flags do. A request past a limit that some profile would let it through
    gets 503 with Retry-After (it may succeed later); past every profile's limit, 400 (it never can)."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, settings: ServerSettings):
        self.engine, self.metrics = engine, metrics
        self.defaults = {"max_num_queued_reqs": settings.max_num_queued_reqs,
                         "max_num_queued_tokens": settings.max_num_queued_tokens, "max_input_tokens": None,
                         "max_priority": None}
        self.limits = dict(self.defaults)
        self.profile: str | None = None
        self.retry_after: Callable[[], float] = lambda: 1.0
        spec = settings.profiles
        sets = [self._resolve(p.live_limits()) for p in spec.profiles.values()] if spec else [self.defaults]
        # the loosest value of each limit over every profile (None: some profile sets no limit)
        self.ceilings = {k: None if any(s[k] is None for s in sets) else max(s[k] for s in sets) for k in INGRESS_LIMITS}

    def _resolve(self, limits: dict) -> dict:
        return {k: self.defaults[k] if limits.get(k) is None else limits[k] for k in INGRESS_LIMITS}

    def apply(self, name: str, limits: dict) -> None:
        self.profile, self.limits = name, self._resolve(limits)

    def _refuse(self, limit: str, n: int, own: int, detail: str, param: str = "prompt") -> None:
        """``own``: what this call alone asks of the limit; past the loosest profile's value it is a 400."""
        ceiling = self.ceilings[limit]
        if ceiling is not None and own > ceiling:
            raise APIError(400, f"{detail}, but this server never admits more than {ceiling} ({limit}); "
                                f"it can never be served here.", "BadRequestError", param)
        where = f"the active profile '{self.profile}'" if self.profile else option(limit)
        self.metrics.rejected[limit] = self.metrics.rejected.get(limit, 0) + n
        raise unavailable(f"{detail}, over the limit of {self.limits[limit]} that {where} sets ({limit}); "
                          f"retry later.", retry_after=round(self.retry_after()))

    def check_room(self, n: int, priority: int = 0) -> None:
        """The limits that need no token counts: a dead engine, requests in flight, the active profile's
        least urgent priority (a shed request costs no tokenizing)."""
        if self.engine.dead is not None:
            raise EngineDeadError(f"The engine stopped: {self.engine.dead!r}")
        if self.limits["max_priority"] is not None and priority > self.limits["max_priority"]:
            self._refuse("max_priority", n, priority, f"A request of priority {priority}", "priority")
        q = self.limits["max_num_queued_reqs"]
        if q is not None and self.engine.num_in_flight + n > q:
            self._refuse("max_num_queued_reqs", n, n, f"This call carries {n} prompts" if n > q else
                         f"{self.engine.num_in_flight} requests are in flight and this call adds {n}")

    def check(self, prompt_lens: list[int], priority: int = 0) -> None:
        """Raise unless every prompt of one API call may enter now."""
        self.check_room(len(prompt_lens), priority)
        n, lim, engine = len(prompt_lens), self.limits, self.engine
        longest, tokens = max(prompt_lens), sum(prompt_lens)
        if lim["max_input_tokens"] is not None and longest > lim["max_input_tokens"]:
            self._refuse("max_input_tokens", n, longest, f"A prompt of {longest} tokens")
        qt = lim["max_num_queued_tokens"]
        if qt is not None and engine.queued_prompt_tokens + tokens > qt:
            self._refuse("max_num_queued_tokens", n, tokens, f"This call's prompts hold {tokens} tokens"
                         if tokens > qt else f"{engine.queued_prompt_tokens} prompt tokens wait and this call "
                                             f"adds {tokens}")


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.served = settings.served_model_names
        self.metrics = ServerMetrics(engine, self.served[0])
        if settings.record_lengths is not None:
            self.metrics.recorder = LengthRecorder(settings.record_lengths)
        engine.observer = self.metrics
        self.admission = Admission(engine, self.metrics, settings)
        self.responses = ResponseStore(settings.max_stored_responses)
        self.degradation = None
        if settings.profiles is not None:
            from pagedserve.server.degradation import Degradation

            self.degradation = Degradation(settings.profiles, self)

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.served:
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(self.served)}.",
                           "NotFoundError", "model")
        return name or self.served[0]

    async def start(self, base_id: str, prompts: list, params, priority: int = 0,
                    stream: bool = True) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt and admit the call as a whole before starting any of its requests; the
        streams come in output order (prompt i's j-th sample is output i * n + j). Tokenizing runs in a
        worker thread, so a long prompt never holds up the event loop. ``stream``: the client reads the
        outputs as they come (every ``stream_interval`` tokens), else only the end."""
        self.admission.check_room(len(prompts) * params.n, priority)  # a full server refuses before tokenizing
        inputs = self.engine.inputs
        made = await asyncio.to_thread(lambda: [r for i, p in enumerate(prompts)
                                                for r in inputs.make_requests(f"{base_id}-{i}", p, params, priority)])
        lens = [req.num_prompt_tokens for req, _ in made]
        if self.degradation is not None:
            self.degradation.window.arrived(lens)
        self.admission.check(lens, priority)
        self.metrics.admitted([req for req, _ in made], params.n)
        if self.settings.log_requests:
            logger.info("Received request %s: %d prompt(s) of %s tokens, %s", base_id, len(lens), lens, params)
        interval = self.settings.stream_interval if stream else None
        return [self.engine.add(req, text, interval) for req, text in made]


async def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state ``build_app`` attached to the app."""
    return request.app.state.server
