"""Token-level routes agentic RL clients use to avoid re-tokenisation drift, in vLLM's shapes:
`POST /tokenize` (a prompt, or chat messages rendered by the model's template, as `/v1/chat/completions`
would render them), `POST /detokenize`, and `GET /version`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field, StrictInt
from starlette.concurrency import run_in_threadpool

from splash.server.errors import APIError
from splash.server.protocol import ChatMessage, _Request
from splash.server.serving import Serving


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None  # a completion prompt ...
    messages: list[ChatMessage] | None = None  # ... or a conversation
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt] = Field(min_length=0)


def install(app: FastAPI, serving: Serving) -> None:
    from splash.version import __version__

    r = APIRouter()

    @r.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give 'prompt' (text) or 'messages' (a conversation), one of them", param="prompt")
        if serving.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt", code="no_tokenizer")
        if req.messages is not None:
            if not req.messages:
                raise APIError("'messages' is empty", param="messages")
            ids = await serving.chat_prompt(req, req.tools)
        else:
            tok = serving.tokenizer
            ids = await run_in_threadpool(
                lambda: list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids,
                               "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = [serving.tokenizer.id_to_token(t) for t in ids]
        return JSONResponse(out)

    @r.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        serving.check_model(req.model)
        if serving.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens", code="no_tokenizer")
        if req.tokens:
            serving.check_ids(req.tokens, "tokens")
        text = await run_in_threadpool(serving.tokenizer.decode, list(req.tokens), False)
        return JSONResponse({"prompt": text})

    @r.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    app.include_router(r)
