"""The server's engine: the core steps in its own thread; the frontend lives on the asyncio loop.

Why a thread and not a process: the core's hot path is torch work that releases the GIL, so the event
loop keeps serving HTTP, tokenizing and detokenizing while a step runs, and a step never waits for the
loop. A thread shares the model runner's memory with no serialization of requests or outputs. The cost
is GIL contention in the Python parts of a step (scheduling, building index arrays), which are small
next to the forward pass on a GPU.

The frontend talks to the core thread only through ``self._inbox`` (add, abort, a call to run on the
core, stop); the core thread hands outputs back with ``loop.call_soon_threadsafe``. Only the core thread
touches the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.core import CoreOutput, EngineCore
from pagedserve.engine.llm_engine import EngineBase
from pagedserve.engine.request import Request
from pagedserve.errors import RequestFailedError
from pagedserve.outputs import RequestOutput, RequestOutputKind, combine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The core thread died; requests in flight are failed with this."""


MAX_FAILED_STEPS = 3  # consecutive failed steps after which the device is taken to be gone


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[EngineCore], Any]    # runs on the core thread, between two steps
    done: "asyncio.Future"


_STOP = object()


class _Outputs:
    """One request's outputs on their way to the task that streams them: a deque and that task's wake-up. An
    ``asyncio.Queue``'s locks and bookkeeping are more than a single reader needs, for every token of every
    stream. ``interval``: new tokens that wake the reader (the first token and the end always do; None: only the
    end), so a stream's frame can carry several tokens and the server writes fewer of them."""

    __slots__ = ("items", "waiter", "interval", "pending", "ready")

    def __init__(self, interval: int | None = 1) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.interval = interval
        self.pending = interval or 0  # tokens put since the reader last took some; the first goes out at once
        self.ready = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        if not (isinstance(item, BaseException) or item.finished):
            if self.interval is None:
                return
            self.pending += len(item.outputs[0].token_ids)
            if self.pending < self.interval:
                return
        self.ready = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        """The next output: the deltas waiting joined into one (also where the stream fell behind the engine, as
        vLLM's output collector joins them), or an error, after the deltas before it."""
        while not self.ready:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        item = self.items.popleft()
        if not isinstance(item, BaseException):
            deltas = [item]
            while self.items and not isinstance(self.items[0], BaseException):
                deltas.append(self.items.popleft())
            if len(deltas) > 1:
                item = combine(deltas)
        self.ready = bool(self.items)  # an error after the deltas: the next call takes it at once
        self.pending = 0
        return item


class AsyncEngine(EngineBase):
    def __init__(self, config: EngineConfig, worker=None):
        super().__init__(config, worker)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, _Outputs] = {}
        # prompt tokens of admitted requests that have no output yet (waiting or prefilling)
        self._unstarted: dict[str, int] = {}
        self.queued_prompt_tokens = 0
        self.observer = None  # optional: .observe(results) after each step, .aborted(rid), .failed(rid)
        self.on_dead: Callable[[], None] | None = None  # called on the loop once the core thread has died
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._core_loop, name="engine-core", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self.core.shutdown()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ------------------------------------------------------------------ the core thread

    def _core_loop(self) -> None:
        core = self.core
        failed_steps = 0
        try:
            while True:
                commands = [self._inbox.get()] if not core.has_unfinished else []
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                outputs: list[CoreOutput] = []
                for cmd in commands:
                    if cmd is _STOP:
                        return
                    if isinstance(cmd, _Add):
                        core.add_request(cmd.request)
                    elif isinstance(cmd, _Abort):
                        outputs.extend(core.abort(cmd.request_ids))
                    elif isinstance(cmd, _Call):
                        try:
                            result = (cmd.fn(core), None)
                        except Exception as e:  # noqa: BLE001 - handed back to the caller
                            result = (None, e)
                        self._loop.call_soon_threadsafe(_resolve, cmd.done, result)
                if core.has_unfinished:
                    try:
                        outputs.extend(core.step())
                        failed_steps = 0
                    except Exception as e:  # fail the step's requests and keep serving the others
                        failed_steps += 1
                        if failed_steps >= MAX_FAILED_STEPS:  # the device itself is gone
                            raise
                        logger.exception("An engine step failed; its requests fail, the others go on")
                        outputs.extend(core.fail_step(e))
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_core_outputs, outputs)
        except BaseException as e:  # noqa: BLE001 - the engine is dead; tell every waiting request
            logger.exception("engine core died")
            self._loop.call_soon_threadsafe(self._fail_all, e)

    # ------------------------------------------------------------------ the loop side

    def _on_core_outputs(self, outputs: list[CoreOutput]) -> None:
        results, to_abort, failed = self.outputs.process(outputs)
        if to_abort or failed:
            self._inbox.put(_Abort([*to_abort, *failed]))
        for res in results:
            self._started(res.request_id)
            q = self._queues.get(res.request_id)
            if q is not None:
                q.put(res)
                if res.finished:  # no longer in flight, whether or not anyone reads the stream
                    del self._queues[res.request_id]
        for rid, error in failed.items():
            if not isinstance(error, RequestFailedError):
                logger.error("Request %s failed while its output was processed", rid, exc_info=error)
                error = RequestFailedError(f"{type(error).__name__}: {error}")
            self._fail(rid, error)
        if self.observer is not None:
            try:
                self.observer.observe(results)
            except Exception:  # metrics must never cost a request its tokens
                logger.exception("Observing outputs for the metrics failed")

    def _fail(self, rid: str, error: BaseException) -> None:
        """End one request's stream with ``error`` (its blocks are freed by the abort the caller sends)."""
        self._started(rid)
        q = self._queues.pop(rid, None)
        if q is not None:
            q.put(error)
            if self.observer is not None:
                self.observer.failed(rid)

    def fail_requests(self, error: BaseException) -> int:
        """End every request in flight with ``error`` and abort it in the core (the engine stays up);
        returns how many there were."""
        rids = list(self._queues)
        for rid in rids:
            self.outputs.abort(rid)
            self._fail(rid, error)
        if rids:
            self._inbox.put(_Abort(rids))
        return len(rids)

    def _fail_all(self, error: BaseException) -> None:
        self.dead = error
        dead = EngineDeadError(f"The engine stopped: {error!r}")
        for q in self._queues.values():
            q.put(dead)
        self._queues.clear()
        self._unstarted.clear()
        self.queued_prompt_tokens = 0
        while True:  # calls the core thread will never run
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call):
                _resolve(cmd.done, (None, dead))
        if self.on_dead is not None:
            self.on_dead()

    def add(self, request: Request, text: str | None, interval: int | None = 1) -> AsyncIterator[RequestOutput]:
        """Admit a request (from ``self.inputs.make_request``, so bad input fails before a response
        starts) and return the stream of its outputs, each holding only what is new (DELTA), until it
        finishes; ``interval``: as ``_Outputs``'s (None: one output, at the end).
        The request counts as in flight from here until it finishes or its stream is closed early (a
        client that went away), which aborts it and frees its KV blocks."""
        if self.dead is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead!r}")
        q = _Outputs(interval)
        self._queues[request.request_id] = q
        self._unstarted[request.request_id] = request.num_prompt_tokens
        self.queued_prompt_tokens += request.num_prompt_tokens
        self.outputs.add(request, text, RequestOutputKind.DELTA)
        self._inbox.put(_Add(request))
        return self._stream(request.request_id, q)

    async def _stream(self, rid: str, q: _Outputs) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort(rid)

    def _started(self, rid: str) -> None:
        """The request has produced output (or ended): its prompt no longer waits."""
        n = self._unstarted.pop(rid, None)
        if n is not None:
            self.queued_prompt_tokens -= n

    def _abort(self, rid: str) -> None:
        if self._queues.pop(rid, None) is None:
            return
        self._started(rid)
        self.outputs.abort(rid)
        self._inbox.put(_Abort([rid]))
        if self.observer is not None:
            self.observer.aborted(rid)

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` on the core thread between two steps and return its result (or raise its
        error): the one way the loop changes the core's state."""
        if self.dead is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead!r}")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(fn, done))
        result, error = await done
        if error is not None:
            raise error
        return result

    async def set_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the scheduler's step limits at runtime (applied between two steps)."""
        await self.call(lambda core: core.set_limits(max_num_seqs, max_num_batched_tokens))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (graceful shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._queues


def _resolve(fut: asyncio.Future, result: tuple[Any, BaseException | None]) -> None:
    if not fut.done():
        fut.set_result(result)
