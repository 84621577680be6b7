"""The FastAPI app: OpenAI routes, SGLang's native routes, /health, /metrics, API key, engine lifespan.

`create_app` takes an already-built engine (the `AsyncEngine` interface: `generate`, `abort`,
`stats`, `tokenizer`, `max_model_len`, `kv_pool_tokens`, `start`, `shutdown`) so tests and the CLI
decide how it is built; the app starts it on startup and shuts it down on exit.
"""

from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splash.server.chat import create_chat_completion
from splash.server.completions import create_completion
from splash.server.errors import APIError, install_error_handlers
from splash.server.metrics import ServerMetrics
from splash.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from splash.server.serving import Serving

log = logging.getLogger("splash.server")
# Generous for token-id prompts at long contexts (~8 bytes per id), small enough that a runaway body is
# refused (413) before it is buffered.
MAX_BODY_BYTES = 64 * 2**20


OPEN_PATHS = ("/health", "/metrics")  # what a load balancer or Prometheus polls without the key


class APIKeyMiddleware:
    """Require `Authorization: Bearer KEY` on every route (/v1/*, the native /generate, weight updates,
    memory release, ...); only /health and /metrics stay open (as in vLLM).

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass through untouched,
    and it runs before body parsing, so an unauthenticated client never learns about body errors.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            got = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(got, self.expected):
                msg = ("Missing API key: send it as 'Authorization: Bearer KEY'" if not got else
                       "Incorrect API key provided.")
                await APIError(msg, status=401, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeMiddleware:
    """Refuse a body over MAX_BODY_BYTES with an OpenAI-shaped 413 instead of buffering it.

    A declared Content-Length is checked up front; a chunked body is read up to the limit here and
    replayed to the app (the client's later messages, e.g. a disconnect, still pass through).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @staticmethod
    async def _too_large(scope: Scope, receive: Receive, send: Send, size: str) -> None:
        err = APIError(f"request body of {size} bytes exceeds the {MAX_BODY_BYTES}-byte limit",
                       status=413, code="request_too_large")
        await err.response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > MAX_BODY_BYTES:
                await self._too_large(scope, receive, send, length)
                return
            await self.app(scope, receive, send)
            return
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            total += len(msg.get("body", b""))
            if total > MAX_BODY_BYTES:
                await self._too_large(scope, receive, send, f"more than {MAX_BODY_BYTES}")
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


def create_app(engine: Any, model_name: str | None = None, api_key: str | None = None,
               on_ready: Callable[[], None] | None = None, launch: dict[str, Any] | None = None) -> FastAPI:
    """The app for one engine; `on_ready` runs once the engine has started (e.g. to print the URL);
    `launch` (host, port, ...) is how it was started, which the server info reports."""
    name = model_name or str(getattr(engine, "model_name", None) or "splash")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if hasattr(engine, "start"):
            await _maybe_await(engine.start())
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            if hasattr(engine, "shutdown"):
                # shutdown() may join the engine thread; do not stall the loop while it does.
                if inspect.iscoroutinefunction(engine.shutdown):
                    await engine.shutdown()
                else:
                    await run_in_threadpool(engine.shutdown)

    app = FastAPI(title="splash", summary="OpenAI-compatible server for MLA models", lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeMiddleware)  # added last = runs first
    metrics = ServerMetrics(name)
    serving = Serving(engine, name, metrics)
    app.state.serving = serving
    app.state.metrics = metrics
    if hasattr(serving.pd, "refused"):  # a prefill: a refused request fails its room at once
        app.state.on_refused = serving.pd.refused

    def card() -> ModelCard:
        return ModelCard(id=name, root=str(getattr(engine, "model_name", name)),
                         max_model_len=serving.max_model_len, vocab_size=serving.vocab_size)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card()]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        serving.check_model(model_id)
        return JSONResponse(card().model_dump())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, req, request)

    from splash.server import native, tokens, weights

    native.install(app, serving, engine, name, launch)  # /generate, /abort_request, /v1/loads, ...
    weights.install(app, engine)  # /update_weights_from_*, /release_memory_occupation, ...
    tokens.install(app, serving)  # /tokenize, /detokenize, /version

    @app.get("/health")
    async def health() -> Response:
        if not _engine_healthy(engine):
            return APIError("engine is not running", status=503, code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        # stats() may take the engine's lock; keep it off the event loop.
        stats = await run_in_threadpool(engine.stats)
        if serving.pd is not None:  # the prefill's rooms waiting for their decode (splash/server/pd_rooms.py)
            stats = {**stats, **serving.pd.stats()}
        metrics.refresh(stats)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _engine_healthy(engine: Any) -> bool:
    for attr in ("is_healthy", "healthy", "is_running", "running"):
        v = getattr(engine, attr, None)
        if v is None:
            continue
        v = v() if callable(v) else v
        if isinstance(v, bool):
            return v
    return not getattr(engine, "errored", False)
