"""Prefill/decode disaggregation in the server: a request's bootstrap fields and each side's half of it.

`--disaggregation-mode prefill|decode` gives the server a role (`role_for`); a request that carries
`bootstrap_room` (sglang-router's PD mode adds it with `bootstrap_host` / `bootstrap_port`) runs through
that role instead of the engine's plain `generate`, and answers as any request does. The prefill's half
is splash/server/pd_rooms.py. The decode's half (`DecodeSide`): reserve the prompt's pages
(`pd_reserve`), POST where they are to the prefill's bootstrap server, long-poll the room, then
`pd_arrived` (the KV and the first token are in place: the request decodes from there) or `pd_fail`
(pages freed, a clear error). Each poll is the prefill's heartbeat: a prefill that stops answering
fails the request within `HEARTBEAT_TIMEOUT_S`, never the server. The arrival's first snapshot is
checked for (`_arrival`): a request the engine dropped meanwhile fails at once instead of hanging.

Mode null ignores the bootstrap fields, as SGLang does: a colocated server answers such a request in
full, so a router or client that adds them loses nothing. A prefill or decode server given a request
without them runs it colocated (it holds the whole model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from splash.engine.outputs import RequestOutput
from splash.engine.sampling import SamplingParams
from splash.engine.streams import EngineError
from splash.server.errors import APIError

log = logging.getLogger("splash.server")

RESERVE_TIMEOUT_S = 60.0  # the decode waits this long for room in its pool
WAITING_TIMEOUT_S = 300.0  # ... and this long for the prefill to finish a room (SGLang's WAITING_TIMEOUT)
HEARTBEAT_TIMEOUT_S = 3.0  # a prefill that answers no poll for this long is gone
RELEASE_TIMEOUT_S = 30.0  # a decode giving a request up waits at most this long for a running write
ARRIVAL_TIMEOUT_S = 5.0  # the arrival's snapshot is in the stream when pd_arrived returns; this bounds it
POLL_S = 2.0  # one long poll
CONNECT_S = 2.0


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's prefill half is: the prefill's bootstrap server and the room pairing the two."""

    host: str | None
    port: int | None
    room: int


def _per_prompt(v: Any, n: int, name: str) -> list[Any]:
    if isinstance(v, list):
        if len(v) != n:
            raise APIError(f"'{name}' lists {len(v)} entries for {n} prompts", param=name)
        return v
    if name == "bootstrap_room" and n > 1 and v is not None:
        raise APIError(f"'bootstrap_room' must list one room per prompt ({n} prompts)", param=name)
    return [v] * n


def bootstraps(req: Any, n: int) -> list[Bootstrap | None] | None:
    """Each prompt's bootstrap (None: the request has none, or that prompt has no room)."""
    if getattr(req, "bootstrap_room", None) is None:
        return None
    hosts = _per_prompt(req.bootstrap_host, n, "bootstrap_host")
    ports = _per_prompt(req.bootstrap_port, n, "bootstrap_port")
    rooms = _per_prompt(req.bootstrap_room, n, "bootstrap_room")
    return [None if r is None else Bootstrap(h, p, int(r)) for h, p, r in zip(hosts, ports, rooms)]


def role_for(engine: Any) -> Any:
    """The server's PD role from its engine's config: None (mode null), `PrefillRooms` or `DecodeSide`."""
    config = getattr(getattr(engine, "engine", engine), "config", None)
    mode = getattr(config, "disaggregation_mode", "null")
    if mode == "prefill":
        from splash.server.pd_rooms import PrefillRooms

        return PrefillRooms(engine)
    if mode == "decode":
        return DecodeSide(engine)
    return None


def run(role: Any, prompt: list[int], params: SamplingParams, rid: str, boot: Bootstrap
        ) -> AsyncIterator[RequestOutput]:
    """The request through the server's role (what `Serving` runs instead of `engine.generate`)."""
    if hasattr(role, "put_dest"):  # the prefill
        return role.generate(prompt, params, rid, boot.room)
    return role.generate(prompt, params, rid, boot)


class PDFailed(Exception):
    """The prefill's half failed: the message says which side and why."""


class DecodeSide:
    """The decode server's half: reserve, tell the prefill, wait for the KV, decode."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._client: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    def stats(self) -> dict[str, Any]:
        return {}

    def client(self) -> Any:
        import httpx

        if self._client is None:  # (made on the server's event loop, its only user)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(POLL_S + HEARTBEAT_TIMEOUT_S,
                                                                   connect=CONNECT_S))
        return self._client

    async def generate(self, prompt: list[int], params: SamplingParams, rid: str, boot: Bootstrap
                       ) -> AsyncIterator[RequestOutput]:
        if boot.host is None or boot.port is None:
            raise APIError("a decode request needs bootstrap_host and bootstrap_port (the prefill's "
                           "bootstrap server); start the router with --prefill URL BOOTSTRAP_PORT",
                           param="bootstrap_port")
        try:
            dest = await self.engine.pd_reserve(rid, prompt, params, timeout_s=RESERVE_TIMEOUT_S)
        except BaseException as e:
            # The router holds the client until both halves answer: the prefill must not wait for a
            # destination that will never come (its bootstrap timeout), so the room is dropped at once.
            self._abandon(boot, f"the decode refused the request: {e}")
            if isinstance(e, TimeoutError):
                raise APIError(f"no room in the decode server's KV pool for this request within "
                               f"{RESERVE_TIMEOUT_S:g} s; retry later", status=503,
                               code="kv_pool_busy") from None
            raise
        stream = self.engine.pd_stream(rid)
        try:
            result = await self._meet(boot, dest)
            prompt_lps = result.get("prompt_logprobs")  # (when the request asked for them)
            firsts = result.get("first_tokens") or [result["first_token"]]  # (one per sequence: n)
            lps = result.get("first_logprobs") or [result.get("logprobs")]
            if len(firsts) != params.n or len(lps) != params.n:
                raise PDFailed(f"the prefill at {boot.host}:{boot.port} sent {len(firsts)} first tokens "
                               f"for n = {params.n} sequences in room {boot.room}")
            await self.engine.pd_arrived(
                rid, [int(t) for t in firsts] if params.n > 1 else int(firsts[0]),
                [_logprobs(d) for d in lps] if params.n > 1 else _logprobs(lps[0]),
                None if prompt_lps is None else [_logprobs(d) for d in prompt_lps],
                drafts=result.get("drafts"), nbytes=result.get("bytes"), fill=result.get("fill"))
            first = await self._arrival(rid, stream)
        except PDFailed as e:
            await self._release(rid, stream, boot, str(e))
            raise APIError(str(e), status=502, type="server_error", code="pd_transfer_failed") from None
        except BaseException as e:  # cancelled (client gone) or anything unexpected: free the pages
            await self._release(rid, stream, boot, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            raise
        async with contextlib.aclosing(stream) as s:
            yield first
            if not first.finished:
                async for out in s:
                    yield out

    async def _arrival(self, rid: str, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The snapshot `pd_arrived` put in the request's stream: it is there once the call returns (the
        engine delivers it before it answers), so the bound is never waited out in the normal case. No
        snapshot means the engine no longer had the request when its KV was taken in: it failed it
        meanwhile (a `release_memory_occupation` between the prefill's write and the arrival fails every
        request waiting for its KV) and that stream would never speak, so the request fails now, 502 (a
        router retries it), instead of hanging until the client gives up."""
        try:
            return await asyncio.wait_for(anext(stream), ARRIVAL_TIMEOUT_S)
        except (TimeoutError, StopAsyncIteration, EngineError):
            log.warning("PD request %s: the decode engine dropped it before its KV was taken in", rid)
            raise PDFailed(f"the decode server dropped request {rid} before its transferred KV was taken in "
                           f"(its KV memory was released meanwhile, or the request was aborted); retry "
                           f"it") from None

    async def _release(self, rid: str, stream: AsyncIterator[RequestOutput], boot: Bootstrap, why: str
                       ) -> None:
        """Drop the room at the prefill, wait out a KV write already running into the reserved pages
        (bounded), then free them: a page is never handed to another request while a transfer may
        still write it. A prefill that does not answer cannot be writing."""
        url = f"http://{_host(boot.host)}:{boot.port}/pd/rooms/{boot.room}"
        with anyio.move_on_after(RELEASE_TIMEOUT_S, shield=True):
            state: str | None = None
            try:
                r = await self.client().delete(url, params={"why": why[:500]})
                state = r.json().get("status") if r.status_code == 200 else None
                while state == "transferring":
                    r = await self.client().get(url, params={"wait": POLL_S})
                    state = r.json().get("status") if r.status_code == 200 else None
            except Exception:  # noqa: BLE001 - unreachable: nothing writes
                state = None
        await self._fail(rid, stream, why)

    async def _fail(self, rid: str, stream: AsyncIterator[RequestOutput], why: str) -> None:
        """pd_fail (pages and slot freed), then end the stream it failed; never left half done."""
        with anyio.move_on_after(10.0, shield=True):
            try:
                await self.engine.pd_fail(rid, why)
            except Exception:  # already gone is fine
                log.debug("pd_fail of %s", rid, exc_info=True)
            with contextlib.suppress(Exception):
                async with contextlib.aclosing(stream) as s:
                    async for _ in s:
                        pass

    def _abandon(self, boot: Bootstrap, why: str) -> None:
        """Tell the prefill to drop the room (best effort, in the background; a room that ended stays)."""
        async def go() -> None:
            with contextlib.suppress(Exception):
                await self.client().delete(f"http://{_host(boot.host)}:{boot.port}/pd/rooms/{boot.room}",
                                           params={"why": why[:500]})

        with contextlib.suppress(RuntimeError):
            task = asyncio.get_running_loop().create_task(go())
            self._tasks.add(task)  # (the loop keeps only a weak reference)
            task.add_done_callback(self._tasks.discard)

    async def _meet(self, boot: Bootstrap, dest: dict[str, Any]) -> dict[str, Any]:
        """POST the destination to the room, then long-poll it until it is done or failed."""
        import httpx

        where = f"{boot.host}:{boot.port}"
        url = f"http://{_host(boot.host)}:{boot.port}/pd/rooms/{boot.room}"
        c = self.client()
        try:
            r = await c.post(url, json={"dest": dest})
        except httpx.HTTPError as e:
            raise PDFailed(f"the prefill's bootstrap server at {where} is unreachable ({type(e).__name__}"
                           f"{': ' + str(e) if str(e) else ''}); is the prefill running with "
                           f"--disaggregation-bootstrap-port {boot.port}?") from None
        if r.status_code != 200:
            raise PDFailed(f"the prefill at {where} refused room {boot.room}: {_message(r)}")
        deadline = time.monotonic() + WAITING_TIMEOUT_S
        silent_since: float | None = None
        while True:
            try:
                r = await c.get(url, params={"wait": POLL_S})
            except httpx.HTTPError as e:
                now = time.monotonic()
                silent_since = silent_since or now
                if now - silent_since >= HEARTBEAT_TIMEOUT_S:
                    raise PDFailed(f"lost the prefill at {where}: no answer for {HEARTBEAT_TIMEOUT_S:g} s "
                                   f"while it held room {boot.room} ({type(e).__name__})") from None
                await asyncio.sleep(0.25)
                continue
            silent_since = None
            if r.status_code != 200:
                raise PDFailed(f"the prefill at {where} lost room {boot.room}: {_message(r)}")
            body = r.json()
            if body.get("status") == "done":
                return body
            if body.get("status") == "failed":
                raise PDFailed(f"the prefill at {where} failed room {boot.room}: {body.get('error')}")
            if time.monotonic() > deadline:
                raise PDFailed(f"the prefill at {where} did not finish room {boot.room} within "
                               f"{WAITING_TIMEOUT_S:g} s")


def _host(host: str | None) -> str:
    return f"[{host}]" if host and ":" in host and not host.startswith("[") else str(host)


def _logprobs(pairs: Any) -> dict[int, float] | None:
    """The first token's logprobs as the room sent them ([token, float.hex] pairs: exact, -inf kept)."""
    if pairs is None:
        return None
    return {int(t): float.fromhex(v) for t, v in pairs}


def _message(r: Any) -> str:
    try:
        body = r.json()
        return str(body.get("error", {}).get("message") or body)
    except Exception:  # noqa: BLE001 - any body
        return f"HTTP {r.status_code} {r.text[:200]}"
