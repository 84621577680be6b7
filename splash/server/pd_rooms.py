"""The prefill's side of prefill/decode disaggregation: its room table and its bootstrap server.

sglang-router posts one body to the prefill and the decode at once with a random `bootstrap_room`. The
two halves meet here, on the prefill's bootstrap server (`--disaggregation-bootstrap-port`): the decode
reserves pages and POSTs where they are (`/pd/rooms/{room}`), the prefill's request with that room waits
for it (either may come first), prefills, writes the KV there through the transfer engine and posts its
result to the room; the decode long-polls the room (`GET /pd/rooms/{room}?wait=S`), each poll also its
heartbeat of the prefill. SGLang's own routes answer as far as they apply to one rank (`GET /health`,
`PUT /route`, `GET /route`). Every wait is bounded: a request whose decode never comes fails after the
bootstrap timeout (that request only), a destination whose request never comes fails its room, and a
room that ended is kept a minute for the decode to read, then forgotten; a room used twice is refused.

The bootstrap server is a second socket of the same uvicorn server (one event loop): `PortDispatch`
sends a connection on the bootstrap port to this app, every other one to the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from splash.engine.outputs import RequestOutput
from splash.engine.sampling import SamplingParams
from splash.server.errors import APIError

log = logging.getLogger("splash.server")

BOOTSTRAP_TIMEOUT_S = 120.0  # a held prefill request (or a destination) waits this long for its other half
KEEP_S = 60.0  # an ended room is kept this long for the decode's last poll (and to refuse a reuse)
MAX_WAIT_S = 10.0  # the longest long poll the bootstrap server grants
OWN_S = 10.0  # this prefill's own transfer sessions are read again after this long

TERMINAL = ("done", "failed")


class Room:
    """One request's meeting point: KVPoll's states, as SGLang names them, in `state`."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.state = "bootstrapping"  # -> waiting_for_input (dest here) -> transferring -> done | failed
        self.dest: dict[str, Any] | None = None
        self.claimed_by: str | None = None  # the prefill request holding the room
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.created = time.monotonic()
        self.ended: float | None = None
        self.dest_event = asyncio.Event()
        self.end_event = asyncio.Event()
        self.task: asyncio.Task[RequestOutput] | None = None

    def fail(self, why: str) -> None:
        if self.state in TERMINAL:
            return
        self.state, self.error, self.ended = "failed", why, time.monotonic()
        self.dest_event.set()  # (a held request wakes up and sees the failure)
        self.end_event.set()

    def succeed(self, result: dict[str, Any]) -> None:
        self.state, self.result, self.ended = "done", result, time.monotonic()
        self.end_event.set()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"room": self.room, "status": self.state}
        if self.state == "failed":
            out["error"] = self.error
        if self.result is not None:
            r = self.result
            lps = r.get("logprobs")
            # float.hex: exact for float64 and carries -inf, which JSON cannot
            firsts = r.get("first_tokens") or [r.get("first_token")]  # (each of the n sequences')
            out.update(first_token=r.get("first_token"), bytes=r.get("bytes", 0), logprobs=_hex(lps),
                       first_tokens=firsts, drafts=r.get("drafts"),  # (MTP: each sequence's first chain)
                       first_logprobs=[_hex(d) for d in r.get("first_logprobs") or [lps]],
                       prompt_logprobs=None if r.get("prompt_logprobs") is None
                       else [_hex(d) for d in r["prompt_logprobs"]])
        return out


def _hex(lps: dict[Any, float] | None) -> list[list[Any]] | None:
    """{token: logprob} as [token, float.hex] pairs: exact for float64, and -inf survives JSON."""
    return None if lps is None else [[int(t), float(v).hex()] for t, v in lps.items()]


class PrefillRooms:
    """The prefill server's rooms: what its requests and its bootstrap server share."""

    def __init__(self, engine: Any, bootstrap_timeout_s: float = BOOTSTRAP_TIMEOUT_S,
                 keep_s: float = KEEP_S) -> None:
        self.engine = engine
        self.timeout_s = bootstrap_timeout_s
        self.keep_s = keep_s
        self.rooms: dict[int, Room] = {}
        self._own: tuple[float, set[str]] | None = None  # (when read, this prefill's ranks' sessions)

    def stats(self) -> dict[str, Any]:
        return {"pd_rooms_bootstrapping": sum(r.state == "bootstrapping" and r.claimed_by is not None
                                              for r in self.rooms.values())}

    def _expire(self) -> None:
        now = time.monotonic()
        for key, r in list(self.rooms.items()):
            if r.ended is not None and now - r.ended > self.keep_s:
                del self.rooms[key]
            elif r.claimed_by is None and r.dest is not None and now - r.created > self.timeout_s:
                r.fail(f"no request for room {key} reached the prefill within {self.timeout_s:g} s of the "
                       f"decode's destination (was it sent to another prefill?)")

    def room(self, key: int, create: bool = True) -> Room | None:
        self._expire()
        r = self.rooms.get(key)
        if r is None and create:
            r = self.rooms[key] = Room(key)
        return r

    # ---- the prefill request's half ------------------------------------------------------------------
    async def generate(self, prompt: list[int], params: SamplingParams, rid: str, room_id: int
                       ) -> AsyncIterator[RequestOutput]:
        """Hold the request until its decode's destination arrives, then prefill it into those pages;
        yields the final output (one token: the first, which the decode continues from)."""
        r = self.room(room_id)
        if r.claimed_by is None and r.state == "failed":  # (the decode gave up before this request came)
            raise APIError(f"prefill of room {room_id}: {r.error}", status=502, param="bootstrap_room",
                           code="pd_bootstrap_failed")
        if r.claimed_by is not None or r.state in TERMINAL:
            raise APIError(f"bootstrap_room {room_id} is already in use by another request; each request "
                           f"needs its own room", param="bootstrap_room", code="duplicate_bootstrap_room")
        r.claimed_by = rid
        try:
            await asyncio.wait_for(r.dest_event.wait(), self.timeout_s)
        except TimeoutError:
            r.fail(f"bootstrap timeout: no decode server sent its destination for room {room_id} within "
                   f"{self.timeout_s:g} s")
        except asyncio.CancelledError:
            r.fail("the prefill request was cancelled (client or router gone)")
            raise
        if r.state == "failed":
            raise APIError(f"prefill of room {room_id}: {r.error}", status=504 if "timeout" in (r.error or "")
                           else 502, param="bootstrap_room", code="pd_bootstrap_failed")
        r.state = "transferring"
        # The prefill and its write run to the end even if this request's client leaves: the decode
        # waits for the result, and pages half written must never be read. (Its own engine id, so the
        # abort that ends a request whose client left does not reach it.)
        r.task = asyncio.create_task(self._prefill(r, prompt, params, f"{rid}-pd{room_id}"))
        r.task.add_done_callback(_retrieved)  # (its error is the room's; a client that left never reads it)
        yield await asyncio.shield(r.task)

    async def _prefill(self, r: Room, prompt: list[int], params: SamplingParams, rid: str) -> RequestOutput:
        assert r.dest is not None
        try:
            out, result = await self.engine.pd_prefill(rid, prompt, params, r.dest)
        except ValueError as e:
            r.fail(f"handshake: {e}")
            raise APIError(f"prefill of room {r.room}: {e}", param="bootstrap_room",
                           code="pd_handshake_failed") from None
        except BaseException as e:
            r.fail(f"the prefill failed: {type(e).__name__}: {e}")
            raise
        if result.get("error"):
            r.fail(f"KV transfer failed: {result['error']}")
            raise APIError(f"prefill of room {r.room}: KV transfer to the decode failed: {result['error']}",
                           status=502, type="server_error", code="kv_transfer_failed")
        r.succeed(result)
        return out

    async def refused(self, request: Any, exc: APIError) -> None:
        """The server refused a request before it reached its room (bad input, too long, ...): its rooms
        fail now with the reason, so the decode waiting on them answers at once (SGLang #30233: never
        decode from a cache the prefill did not fill)."""
        if request.method != "POST":
            return
        try:
            body = json.loads(await request.body())
        except Exception:  # noqa: BLE001 - not JSON: no room to tell
            return
        rooms = body.get("bootstrap_room") if isinstance(body, dict) else None
        for key in rooms if isinstance(rooms, list) else [rooms]:
            if isinstance(key, int) and not isinstance(key, bool):
                r = self.room(key)
                if r.claimed_by is None:  # (never another request's room: a duplicate is refused too)
                    r.fail(f"the prefill refused the request: {exc.message}")

    # ---- the decode's half (the bootstrap server's routes) -------------------------------------------
    async def put_dest(self, room_id: int, dest: dict[str, Any]) -> None:
        """The decode's destination for a room (before or after the request reached the prefill)."""
        r = self.room(room_id)
        if r.state == "failed":
            raise APIError(f"room {room_id} failed: {r.error}", status=409, param="room", code="room_failed")
        if r.dest is not None or r.state in TERMINAL:
            raise APIError(f"room {room_id} already has a destination (or ended): a room pairs one "
                           f"request", status=409, param="room", code="duplicate_bootstrap_room")
        layout = dest.get("layout")
        if not isinstance(layout, dict) or dest.get("session_id") != layout.get("session_id"):
            raise APIError("the destination needs its decode's layout, whose session_id is the "
                           "destination's", param="dest.layout", code="invalid_destination")
        mine = _sessions(layout) & await self._own_sessions()
        if mine:  # (a write into this prefill's own pools)
            raise APIError(f"the destination's session {sorted(mine)[0]} is this prefill's own",
                           param="dest.session_id", code="invalid_destination")
        try:
            await self.engine.pd_check_peer(layout)
        except ValueError as e:
            r.fail(f"handshake: {e}")
            raise APIError(f"the prefill and the decode disagree: {e}", param="dest.layout",
                           code="pd_handshake_failed") from None
        r.dest, r.state = dest, "waiting_for_input"
        r.dest_event.set()

    async def _own_sessions(self) -> set[str]:
        """This prefill's ranks' transfer sessions (read again after OWN_S: a memory release and resume
        starts new ones)."""
        if self._own is None or time.monotonic() - self._own[0] > OWN_S:
            self._own = (time.monotonic(), _sessions(await self.engine.pd_layout_info()))
        return self._own[1]

    async def poll(self, room_id: int, wait_s: float) -> dict[str, Any]:
        r = self.room(room_id, create=False)
        if r is None:
            raise APIError(f"room {room_id} is unknown here (the prefill restarted, or the room expired)",
                           status=404, param="room", code="unknown_room")
        if r.state not in TERMINAL and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.end_event.wait(), min(wait_s, MAX_WAIT_S))
        return r.status()

    def abandon(self, room_id: int, why: str) -> str:
        """The decode gave the request up: a room not yet prefilling fails (its held request with it);
        its state after, which the decode waits on while it is "transferring"."""
        r = self.room(room_id)  # (created when the prefill's request has not come yet: it is refused then)
        if r.state in ("bootstrapping", "waiting_for_input"):
            r.fail(why)
        return r.state


def _sessions(layout: dict[str, Any]) -> set[str]:
    """Every transfer session a layout names: rank 0's at the top level, each rank's under "ranks"."""
    out = {layout.get("session_id"), *(r.get("session_id") for r in layout.get("ranks") or ()
                                       if isinstance(r, dict))}
    return {str(x) for x in out if x}


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def bootstrap_app(rooms: PrefillRooms, page_size: int | None) -> FastAPI:
    """The bootstrap server's routes (no API key: it listens where only the decode servers reach)."""
    app = FastAPI(title="splash bootstrap", openapi_url=None, docs_url=None, redoc_url=None)
    registered: dict[str, dict[str, Any]] = {}

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("OK")

    @app.put("/route")
    async def put_route(request: Request) -> PlainTextResponse:
        """SGLang's prefill ranks register here; one splash rank registers nothing, but a peer may."""
        body = await request.json()
        registered[f"{body.get('attn_dp_rank', 0)}:{body.get('engine_rank', body.get('attn_tp_rank', 0))}"] \
            = body
        return PlainTextResponse("OK")

    @app.get("/route")
    async def get_route(engine_rank: int = -1, target_dp_group: int = -1) -> JSONResponse:
        """SGLang's answers: the prefill's parallel sizes (ranks -1), else a rank's transfer info."""
        if engine_rank == -1 and target_dp_group == -1:
            return JSONResponse({"prefill_attn_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1,
                                 "prefill_page_size": page_size})
        if engine_rank != 0 or target_dp_group not in (-1, 0):
            return JSONResponse({"error": f"this prefill has one rank (engine_rank 0, dp group 0), not "
                                          f"{engine_rank}/{target_dp_group}"}, status_code=404)
        info = await rooms.engine.pd_layout_info()
        host, _, port = str(info.get("session_id", "")).rpartition(":")
        return JSONResponse({"rank_ip": host, "rank_port": int(port) if port.isdigit() else None,
                             "layout": info})

    @app.post("/pd/rooms/{room}")
    async def post_dest(room: int, request: Request) -> JSONResponse:
        body = await request.json()
        dest = body.get("dest") if isinstance(body, dict) else None
        if not isinstance(dest, dict):
            raise APIError("send {\"dest\": {...}}: the decode's destination for the room", param="dest")
        await rooms.put_dest(room, dest)
        return JSONResponse({"room": room, "accepted": True})

    @app.get("/pd/rooms/{room}")
    async def get_room(room: int, wait: float = 0.0) -> JSONResponse:
        return JSONResponse(await rooms.poll(room, wait))

    @app.delete("/pd/rooms/{room}")
    async def delete_room(room: int, why: str = "") -> JSONResponse:
        state = rooms.abandon(room, f"the decode gave the request up{': ' + why if why else ''}")
        return JSONResponse({"room": room, "status": state})

    return app


class PortDispatch:
    """One uvicorn server, two sockets: connections to `port` go to `side`, the rest (and the lifespan)
    to `main`."""

    def __init__(self, main: ASGIApp, side: ASGIApp, port: int) -> None:
        self.main, self.side, self.port = main, side, port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") or (None, None)
        if scope["type"] in ("http", "websocket") and server[1] == self.port:
            await self.side(scope, receive, send)
        else:
            await self.main(scope, receive, send)
