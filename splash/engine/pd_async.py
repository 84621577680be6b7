"""The server's calls of prefill/decode disaggregation on an `AsyncEngine` (a mixin of it): each runs the
engine's `pd` part (splash/engine/stages/pd.py) on the engine thread between two steps, and the request's
snapshots come back through the same streams as `generate`'s.

Decode server: `pd_reserve` (pages parked for the prompt; the destination to send the prefill), then
`pd_arrived` (KV in place, first token) or `pd_fail`, and `pd_stream` for the snapshots. Prefill server:
`pd_prefill` (the prompt run, its KV written to the destination; the final snapshot and the outcome).
Leaving a stream early, or a call cancelled half-way, aborts the request: nothing stays held.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from splash.engine.outputs import RequestOutput
from splash.engine.sampling import SamplingParams
from splash.engine.stages.pd import PDNoRoom
from splash.engine.streams import EngineError, Mailbox


class PDAsync:
    """Mixin of AsyncEngine (it provides `start`, `call`, `_streams`, `_cmds`, `_deliver_all`)."""

    _streams: dict[str, Any]
    _cmds: Any

    async def pd_layout_info(self) -> dict[str, Any]:
        """This engine's transfer layout (what the handshake sends the peer)."""
        return await self.call(lambda eng: eng.pd.layout_info())  # type: ignore[attr-defined]

    async def pd_check_peer(self, info: dict[str, Any]) -> None:
        """ValueError naming the first difference between this engine and the peer's layout `info`."""
        await self.call(lambda eng: eng.pd.check_peer(info))  # type: ignore[attr-defined]

    def _open(self, request_id: str) -> Mailbox:
        self.start()  # type: ignore[attr-defined]
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        box = Mailbox()
        self._streams[request_id] = (asyncio.get_running_loop(), box)
        return box

    def _drop(self, request_id: str) -> None:
        """Forget the stream and abort the request (a no-op if the engine no longer has it)."""
        self._streams.pop(request_id, None)
        self._cmds.put(("abort", (request_id, None)))

    # ---- decode side ----------------------------------------------------------------------------
    async def pd_reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         timeout_s: float = 30.0) -> dict[str, Any]:
        """Park `request_id` on pages for its prompt; -> the destination (JSON-able) for the prefill side.
        Waits while there is no room now; ValueError if it can never run, TimeoutError after `timeout_s`."""
        self._open(request_id)
        ids = list(prompt_token_ids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                try:
                    return await self.call(  # type: ignore[attr-defined, no-any-return]
                        lambda eng: eng.pd.reserve(request_id, ids, params))
                except PDNoRoom as e:
                    if loop.time() >= deadline:
                        raise TimeoutError(f"{e} (waited {timeout_s:.0f} s)") from None
                    await asyncio.sleep(0.02)
        except BaseException:
            self._drop(request_id)
            raise

    async def pd_arrived(self, request_id: str, first_token: int | list[int],
                         first_logprobs: dict[Any, float] | list[dict[Any, float] | None] | None = None,
                         prompt_logprobs: list[dict[Any, float] | None] | None = None,
                         drafts: list[list[int]] | None = None, nbytes: int | None = None,
                         fill: list[dict[str, Any]] | None = None) -> None:
        """The prefill side wrote the KV of `request_id`: it decodes from `first_token` on (n > 1: one
        per sequence, with `first_logprobs` one per sequence too; and reports the prefill side's
        `prompt_logprobs`, if the request asked; `drafts`: its result["drafts"], MTP's first chains;
        `nbytes`, `fill`: its result["bytes"] and ["fill"], what it wrote and the replicas this side
        completes itself)."""
        def go(eng: Any) -> None:
            if request_id not in eng.pd.decode.parked:
                # Failed meanwhile (a KV release between the write and this call): its stream ends here
                # instead of waiting for snapshots that never come.
                err = EngineError(f"request {request_id} no longer waits for its KV (aborted or failed "
                                  "while the prefill wrote it)")
                self._deliver_all([(request_id, err)])  # type: ignore[attr-defined]
                return
            outs = eng.pd.arrived(request_id, first_token, first_logprobs, prompt_logprobs, drafts, nbytes,
                                  fill)
            self._deliver_all([(o.request_id, o) for o in outs])  # type: ignore[attr-defined]

        await self.call(go)  # type: ignore[attr-defined]

    async def pd_fail(self, request_id: str, reason: str) -> None:
        """The KV of `request_id` will not come: its pages are freed, its stream ends with EngineError."""
        def go(eng: Any) -> None:
            eng.pd.fail(request_id, reason)
            self._deliver_all([(request_id, EngineError(reason))])  # type: ignore[attr-defined]

        await self.call(go)  # type: ignore[attr-defined]

    async def pd_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative snapshots of a reserved request (from `pd_arrived` on) until it finishes; EngineError
        if it failed. Leaving early aborts it and frees its pages (also while its KV has not arrived)."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise ValueError(f"request {request_id!r} was not reserved (pd_reserve) or has ended")
        box = stream[1]
        finished = False
        try:
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if finished:
                self._streams.pop(request_id, None)
            else:
                self._drop(request_id)

    # ---- prefill side ---------------------------------------------------------------------------
    async def pd_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         dest: dict[str, Any]) -> tuple[RequestOutput, dict[str, Any]]:
        """Run the prompt here (max_tokens 1) and write its KV into `dest` (the decode side's
        `pd_reserve`). -> (final snapshot, result: first_token, logprobs, error, bytes, seconds). A
        peer that differs: ValueError naming the difference, before anything runs."""
        box = self._open(request_id)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()

        def on_done(result: dict[str, Any]) -> None:  # (engine thread)
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        finished = False
        try:
            ids = list(prompt_token_ids)
            await self.call(  # type: ignore[attr-defined]
                lambda eng: eng.pd.add_prefill(request_id, ids, params, dest, on_done))
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                    return item, await done
        finally:
            if finished:
                self._streams.pop(request_id, None)
            else:
                self._drop(request_id)
