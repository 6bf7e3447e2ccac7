"""The synchronous engine: frontend processors and the core in one thread (the offline API's engine)."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.processor import InputProcessor, OutputProcessor, Prompt, load_tokenizer
from pagedserve.errors import RequestFailedError
from pagedserve.outputs import RequestOutput, RequestOutputKind
from pagedserve.sampling_params import SamplingParams


class EngineBase:
    """An engine core with its tokenizer and frontend processors: what the offline and the server
    engines both hold."""

    def __init__(self, config: EngineConfig, worker=None):
        """``worker``: what runs the steps (default: the model on the configured device; the simulator's
        calibration passes one that prices steps instead)."""
        self.tokenizer = load_tokenizer(config)
        self.core = EngineCore(config, worker=worker)
        self.config = self.core.config  # as the worker sized it (--max-model-len auto)
        self.inputs = InputProcessor(self.config, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)


class LLMEngine(EngineBase):
    """Everything in the caller's thread: add requests, then call ``step`` until none is unfinished."""

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, priority: int = 0) -> list[str]:
        """Add the prompt's ``params.n`` requests; returns their ids (``request_id`` itself when n is 1).
        ``output_kind``: what each of their outputs from ``step`` holds; ``priority``: see
        ``--scheduling-policy``."""
        made = self.inputs.make_requests(request_id, prompt, params, priority)
        for request, text in made:
            self.outputs.add(request, text, output_kind)
            self.core.add_request(request)
        return [request.request_id for request, _ in made]

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)
        for rid in request_ids:
            self.outputs.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished

    def step(self) -> list[RequestOutput]:
        results, to_abort, failed = self.outputs.process(self.core.step())
        if to_abort or failed:
            self.core.abort([*to_abort, *failed])
        if failed:
            rid, error = next(iter(failed.items()))
            raise RequestFailedError(f"request {rid} failed: {error}") from error
        return results
