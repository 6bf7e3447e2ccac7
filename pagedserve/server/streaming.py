"""Output streams of one API call: several requests merged, SSE frames, and aborts on disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from fastapi import Request

from pagedserve.outputs import RequestOutput, combine
from pagedserve.server.errors import error_body, status_of


def sse(obj: dict) -> bytes:
    """One SSE frame: a frame goes out for every token of every stream, so it is encoded by orjson (a tenth of
    the standard library's time), as bytes the transport writes as they are."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs (one per prompt); closing it aborts all of them."""
    if len(streams) == 1:  # the common call: no task and no second queue between the engine and the client
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Disconnected(Exception):
    pass


async def until_disconnect(request: Request, coro):
    """Run ``coro`` unless the client goes away first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise Disconnected()


async def sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """SSE frames of ``events``, an in-stream error if one is raised (the status is already sent), [DONE]."""
    try:
        async for obj in events:
            yield sse(obj)
    except Exception as e:  # noqa: BLE001
        status, kind = status_of(e)
        yield sse(error_body(status, str(e), kind))
    yield b"data: [DONE]\n\n"


async def final_outputs(request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput] | None:
    """Each stream's finished output, in order; None if the client went away first (all are aborted)."""
    async def collect():
        deltas: list[list[RequestOutput]] = [[] for _ in streams]
        async for i, out in merged(streams):
            deltas[i].append(out)
        return [combine(d) for d in deltas]

    try:
        return await until_disconnect(request, collect())
    except Disconnected:
        return None
