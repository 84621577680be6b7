"""POST /v1/completions: prompts (text or token ids) in, OpenAI `text_completion` objects out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splash.engine.outputs import CompletionOutput
from splash.server.errors import APIError
from splash.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    stream_chunk,
)
from splash.server.serving import Serving, finite, new_id
from splash.server.streaming import DONE, sse, sse_response, until_disconnect


def completion_logprobs(serving: Serving, out: CompletionOutput, start: int, k: int,
                        offset: int) -> CompletionLogProbs:
    """Logprobs of tokens `start:` of one sequence, in the legacy completions layout."""
    lp = CompletionLogProbs()
    for i in range(start, len(out.token_ids)):
        tid = out.token_ids[i]
        entry = out.logprobs[i] if out.logprobs and i < len(out.logprobs) else {}
        tok = serving.token_str(tid)
        lp.tokens.append(tok)
        lp.token_logprobs.append(finite(entry[tid]) if tid in entry else None)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:max(k, 1)] if entry else []
        lp.top_logprobs.append({serving.token_str(t): finite(v) for t, v in top} if top else None)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


async def create_completion(serving: Serving, req: CompletionRequest, request: Request) -> Response:
    serving.check_model(req.model)
    serving.check_supported(req)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    prompts = await serving.completion_prompts(req.prompt)
    params = [serving.sampling_params(req, serving.max_tokens_for(len(p), req.max_tokens, "max_tokens"),
                                      req.logprobs) for p in prompts]
    rid, created = new_id("cmpl"), int(time.time())
    if req.stream:
        return sse_response(_stream(serving, req, prompts, params, rid, created))
    return await until_disconnect(request, _full(serving, req, prompts, params, rid, created))


async def _full(serving: Serving, req: CompletionRequest, prompts, params, rid: str, created: int
                ) -> JSONResponse:
    final = {}
    async with contextlib.aclosing(serving.generate(prompts, params, rid)) as gen:
        async for i, out in gen:
            if out.finished:
                final[i] = out
    if len(final) != len(prompts):
        raise APIError("the engine stopped before the request finished; retry", status=503)
    choices, completion_tokens = [], 0
    for i in sorted(final):
        for o in final[i].outputs:
            completion_tokens += len(o.token_ids)
            lp = (completion_logprobs(serving, o, 0, req.logprobs, 0) if req.logprobs is not None
                  else None)
            choices.append(CompletionChoice(index=i * req.n + o.index, text=o.text, logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    choices.sort(key=lambda c: c.index)
    prompt_tokens = sum(len(p) for p in prompts)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    resp = CompletionResponse(id=rid, created=created, model=serving.model_name, choices=choices,
                              usage=usage)
    return JSONResponse(resp.model_dump())


async def _stream(serving: Serving, req: CompletionRequest, prompts, params, rid: str, created: int
                  ) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    n = req.n
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    tokens_by_prompt: dict[int, int] = {}

    def chunk(choice: CompletionChoice) -> str:
        return sse(stream_chunk("text_completion", rid, created, serving.model_name, [choice], None,
                                include_usage))

    async with contextlib.aclosing(serving.generate(prompts, params, rid)) as gen:
        async for i, out in gen:
            tokens_by_prompt[i] = sum(len(o.token_ids) for o in out.outputs)
            for o in out.outputs:
                key = i * n + o.index
                t0, k0 = sent_text.get(key, 0), sent_tokens.get(key, 0)
                if t0 < 0:
                    continue  # this sequence already sent its finish chunk
                delta, new_tokens = o.text[t0:], len(o.token_ids) - k0
                if delta or new_tokens > 0:
                    lp = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(serving, o, k0, req.logprobs, offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp.tokens)
                    yield chunk(CompletionChoice(index=key, text=delta, logprobs=lp))
                    sent_text[key], sent_tokens[key] = len(o.text), len(o.token_ids)
                if o.finish_reason is not None:
                    yield chunk(CompletionChoice(index=key, text="", finish_reason=o.finish_reason,
                                                 stop_reason=o.stop_reason))
                    sent_text[key] = -1
    if include_usage:
        pt, ct = sum(len(p) for p in prompts), sum(tokens_by_prompt.values())
        usage = UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)
        yield sse(stream_chunk("text_completion", rid, created, serving.model_name, [], usage, True))
    yield DONE
