"""POST /v1/completions: prompts (text or token ids) in, OpenAI `text_completion` objects out.

`echo` puts the prompt before the completion; with `logprobs` it carries the prompt's logprobs too
(the first token's null), and `max_tokens` 0 scores the prompt alone: lm-evaluation-harness's
`local-completions` loglikelihood requests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splash.engine.outputs import CompletionOutput, RequestOutput
from splash.server.errors import APIError
from splash.server.guides import structured_from
from splash.server.pd import bootstraps
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


def prompt_logprobs(serving: Serving, ro: RequestOutput, k: int) -> CompletionLogProbs:
    """The prompt's tokens in the legacy layout (echo): the first token has no logprob (null, as OpenAI and
    vLLM), every other one its logprob given the tokens before it and the top `k`."""
    lp = CompletionLogProbs()
    offset = 0
    pl = ro.prompt_logprobs or [None] * len(ro.prompt_token_ids)
    for tid, entry in zip(ro.prompt_token_ids, pl):
        tok = serving.token_str(tid)
        lp.tokens.append(tok)
        lp.token_logprobs.append(None if entry is None else finite(entry.get(tid)))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:max(k, 1)] if entry else []
        lp.top_logprobs.append({serving.token_str(t): finite(v) for t, v in top} if entry else None)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


def _join(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs, tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


def _prompt_texts(serving: Serving, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """What echo prints for each prompt: the text sent, or the ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    tok = serving.tokenizer
    if tok is None:
        return ["" for _ in prompts]
    try:
        return [tok.decode(p, skip_special_tokens=False) for p in prompts]
    except TypeError:
        return [tok.decode(p) for p in prompts]


async def create_completion(serving: Serving, req: CompletionRequest, request: Request) -> Response:
    serving.check_model(req.model)
    serving.check_supported(req)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    prompts = await serving.completion_prompts(req.prompt)
    scored = req.logprobs if req.echo else None  # echo + logprobs: the prompt's logprobs too
    # max_tokens 0 (echo only): the engine samples one token, which the answer leaves out
    budgets = [max(1, serving.max_tokens_for(len(p), req.max_tokens, "max_tokens")) for p in prompts]
    structured, param = structured_from(req)
    if structured is not None:
        await serving.compile_guide(structured, param or "response_format")
    params = [serving.sampling_params(req, m, req.logprobs, prompt_logprobs=scored, structured=structured)
              for m in budgets]
    echo = _prompt_texts(serving, req.prompt, prompts) if req.echo else None
    boots = bootstraps(req, len(prompts))  # prefill/decode disaggregation (splash/server/pd.py)
    rid, created = new_id("cmpl"), int(time.time())
    if req.stream:
        return sse_response(_stream(serving, req, prompts, params, rid, created, echo, boots))
    return await until_disconnect(request, _full(serving, req, prompts, params, rid, created, echo, boots))


def _generated(req: CompletionRequest, o: CompletionOutput) -> CompletionOutput:
    """The sequence as answered: with max_tokens 0 nothing generated (the one sampled token dropped)."""
    if req.max_tokens != 0:
        return o
    return CompletionOutput(index=o.index, token_ids=[], text="", logprobs=[] if o.logprobs is not None
                            else None, finish_reason="length")


async def _full(serving: Serving, req: CompletionRequest, prompts, params, rid: str, created: int,
                echo: list[str] | None, boots: list[Any] | None = None) -> JSONResponse:
    final = {}
    async with contextlib.aclosing(serving.generate(prompts, params, rid, boots=boots)) as gen:
        async for i, out in gen:
            if out.finished:
                final[i] = out
    if len(final) != len(prompts):
        raise APIError("the engine stopped before the request finished; retry", status=503)
    choices, completion_tokens = [], 0
    for i in sorted(final):
        head = prompt_logprobs(serving, final[i], req.logprobs) if echo and req.logprobs is not None else None
        for o in final[i].outputs:
            o = _generated(req, o)
            completion_tokens += len(o.token_ids)
            lp = None
            if req.logprobs is not None:
                start = sum(len(t) for t in head.tokens) if head is not None else 0
                lp = completion_logprobs(serving, o, 0, req.logprobs, start)
                lp = _join(head, lp) if head is not None else lp
            text = (echo[i] if echo else "") + o.text
            ids = req.return_token_ids
            choices.append(CompletionChoice(index=i * req.n + o.index, text=text, logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                            token_ids=list(o.token_ids) if ids else None,
                                            prompt_token_ids=list(prompts[i]) if ids else None))
    choices.sort(key=lambda c: c.index)
    usage = UsageInfo.of(sum(len(p) for p in prompts), completion_tokens,
                         sum(out.num_cached_tokens for out in final.values()))
    resp = CompletionResponse(id=rid, created=created, model=serving.model_name, choices=choices,
                              usage=usage)
    return JSONResponse(resp.model_dump())


async def _stream(serving: Serving, req: CompletionRequest, prompts, params, rid: str, created: int,
                  echo: list[str] | None, boots: list[Any] | None = None) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    n = req.n
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    tokens_by_prompt: dict[int, int] = {}
    cached_by_prompt: dict[int, int] = {}

    def chunk(choice: CompletionChoice) -> str:
        return sse(stream_chunk("text_completion", rid, created, serving.model_name, [choice], None,
                                include_usage))

    async with contextlib.aclosing(serving.generate(prompts, params, rid, boots=boots)) as gen:
        async for i, out in gen:
            outs = [_generated(req, o) for o in out.outputs]
            tokens_by_prompt[i] = sum(len(o.token_ids) for o in outs)
            cached_by_prompt[i] = out.num_cached_tokens
            for o in outs:
                key = i * n + o.index
                if echo and key not in sent_text:
                    # the prompt first: snapshots come once a token is sampled, so its prefill is done
                    head = prompt_logprobs(serving, out, req.logprobs) if req.logprobs is not None else None
                    offsets[key] = sum(len(t) for t in head.tokens) if head else 0
                    yield chunk(CompletionChoice(index=key, text=echo[i], logprobs=head,
                                                 prompt_token_ids=list(prompts[i]) if req.return_token_ids
                                                 else None))
                    sent_text[key], sent_tokens[key] = 0, 0
                t0, k0 = sent_text.get(key, 0), sent_tokens.get(key, 0)
                if t0 < 0:
                    continue  # this sequence already sent its finish chunk
                delta, new_tokens = o.text[t0:], len(o.token_ids) - k0
                if delta or new_tokens > 0:
                    lp = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(serving, o, k0, req.logprobs, offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp.tokens)
                    ids = list(o.token_ids[k0:]) if req.return_token_ids else None
                    first = list(prompts[i]) if req.return_token_ids and k0 == 0 and not echo else None
                    yield chunk(CompletionChoice(index=key, text=delta, logprobs=lp, token_ids=ids,
                                                 prompt_token_ids=first))
                    sent_text[key], sent_tokens[key] = len(o.text), len(o.token_ids)
                if o.finish_reason is not None:
                    yield chunk(CompletionChoice(index=key, text="", finish_reason=o.finish_reason,
                                                 stop_reason=o.stop_reason))
                    sent_text[key] = -1
    if include_usage:
        usage = UsageInfo.of(sum(len(p) for p in prompts), sum(tokens_by_prompt.values()),
                             sum(cached_by_prompt.values()))
        yield sse(stream_chunk("text_completion", rid, created, serving.model_name, [], usage, True))
    yield DONE
