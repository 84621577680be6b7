"""OpenAI-shaped errors: every failure a client can cause comes back as `{"error": {...}}` with a 4xx.

Clients (the `openai` package among them) parse this shape to raise typed exceptions, so FastAPI's
default 422 body and Starlette's plain-text 404/405 are replaced here too.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("splash.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server refuses; `status` picks the HTTP code, the rest is the OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500
                                                 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role' (the field a client must fix)."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and not _is_union_tag(p):
            out += f".{p}" if out else p
    return out or None


def _is_union_tag(p: str) -> bool:
    # pydantic names union members in `loc` ("str", "list[int]", "function-after[...]"); not a field.
    return p in {"str", "int", "float", "bool"} or "[" in p or p.startswith("function-")


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn pydantic's list of errors into one clear line naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    etype = first.get("type", "")
    if etype == "json_invalid":
        return APIError(f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                        code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if etype == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if etype == "missing":
        if param is None:
            return APIError("request body is missing; send a JSON object", code="invalid_body")
        return APIError(f"'{param}' is a required property", param=param, code="missing_required_field")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return APIError(f"request body must be a JSON object: {msg}", code="invalid_body")
    return APIError(f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


async def _tell(request: Request, exc: APIError) -> None:
    """A refused request's listener, if the app has one (`app.state.on_refused`: a prefill server tells
    the decode waiting on the request's bootstrap room at once, rather than after a timeout)."""
    hook = getattr(request.app.state, "on_refused", None)
    if hook is not None:
        try:
            await hook(request, exc)
        except Exception:  # noqa: BLE001 - the refusal itself still answers
            log.debug("on_refused hook failed", exc_info=True)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        await _tell(request, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        await _tell(request, err)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(str(exc.detail), status=exc.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        return APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500,
                        type="server_error").response()
