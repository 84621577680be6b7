"""Server-sent events and client-disconnect handling shared by the generation endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from splash.server.errors import APIError

log = logging.getLogger("splash.server")
T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Wrap chunk events so a failure mid-stream ends with an error event and `[DONE]`, not a cut."""

    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events) as ev:
                async for e in ev:
                    yield e
        except APIError as e:
            yield sse(e.body())
            yield DONE
        except Exception as e:
            log.exception("error while streaming a response")
            yield sse(APIError(f"internal server error: {type(e).__name__}: {e}", status=500,
                               type="server_error").body())
            yield DONE

    # Starlette cancels `body` when the client disconnects; the cancellation unwinds into the
    # engine's generator, whose cleanup aborts the request.
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away first.

    A non-streaming response is only written at the end, so without this a client that gave up would
    keep its request running to `max_tokens`.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        # Wait for both to unwind so the work's cleanup (engine aborts) has run before we answer.
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise APIError("client disconnected", status=499, code="client_closed_request")
    return task.result()
