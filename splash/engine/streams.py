"""The asyncio side of the engine's streams: each request's mailbox (its newest unread snapshot, or
the error that ended it) and the errors a stream can end with (splash/engine/async_engine.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from splash.engine.outputs import RequestOutput


class EngineError(RuntimeError):
    """The engine failed while running a request (the request was aborted, its pages freed)."""


class EngineDeadError(EngineError):
    """The engine was shut down; no request can run any more."""


class Mailbox:
    """One request's newest unread snapshot, or the error that ended it (lives on the consumer's loop).

    A new snapshot replaces an unread one - it contains it - so a client that stops reading holds one
    snapshot, not one per step. An error is never replaced: it is what the consumer must see next."""

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._item, BaseException):
            self._item = item
            self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._item = self._item, None
        assert item is not None
        return item


Stream = tuple[asyncio.AbstractEventLoop, Mailbox]


def put_all(batch: list[tuple[str, Mailbox, Any]]) -> None:
    for _, box, item in batch:
        box.put(item)
