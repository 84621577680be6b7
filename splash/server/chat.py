"""POST /v1/chat/completions: messages (tools, tool calls and results, reasoning included) through the
model's chat template, assistant turns out: reasoning apart from content, tool calls parsed in the
model's own format (whole, or streamed name first then argument pieces), a response format or a required
tool call enforced by grammar (splash/server/chat_parse.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splash.engine.outputs import CompletionOutput
from splash.server.chat_parse import ChatPlan, ChoiceParser, plan_chat
from splash.server.errors import APIError
from splash.server.pd import bootstraps
from splash.server.protocol import (
    ChatChoice,
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    TopLogProb,
    UsageInfo,
    stream_chunk,
)
from splash.server.serving import Serving, finite, new_id
from splash.server.streaming import DONE, sse, sse_response, until_disconnect


def chat_logprobs(serving: Serving, out: CompletionOutput, start: int, k: int) -> ChatChoiceLogProbs:
    """Logprobs of tokens `start:` of one sequence, in the chat layout (token, logprob, bytes, top)."""
    content = []
    for i in range(start, len(out.token_ids)):
        tid = out.token_ids[i]
        entry = out.logprobs[i] if out.logprobs and i < len(out.logprobs) else {}
        tok = serving.token_str(tid)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k] if k else []
        content.append(ChatLogProb(
            token=tok, logprob=finite(entry.get(tid)), bytes=list(tok.encode()),
            top_logprobs=[_top(serving.token_str(t), v) for t, v in top]))
    return ChatChoiceLogProbs(content=content)


def _top(tok: str, lp: float) -> TopLogProb:
    return TopLogProb(token=tok, logprob=finite(lp), bytes=list(tok.encode()))


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, request: Request) -> Response:
    serving.check_model(req.model)
    serving.check_supported(req)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = plan_chat(req, serving.tool_parser, serving.reasoning_parser, serving.special_ids)
    prompt = await serving.chat_prompt(req, plan.tools)
    if plan.structured is not None:
        await serving.compile_guide(plan.structured, plan.structured_param or "response_format")
    if req.max_completion_tokens is not None:
        requested, pname = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, pname = req.max_tokens, "max_tokens"
    max_tokens = serving.max_tokens_for(len(prompt), requested, pname)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, max_tokens, top, structured=plan.structured,
                                     skip_special_tokens=False if plan.parses else None)
    boots = bootstraps(req, 1)  # prefill/decode disaggregation (splash/server/pd.py)
    rid, created = new_id("chatcmpl"), int(time.time())
    if req.stream:
        return sse_response(_stream(serving, req, plan, prompt, params, rid, created, boots))
    return await until_disconnect(request, _full(serving, req, plan, prompt, params, rid, created, boots))


async def _full(serving: Serving, req: ChatCompletionRequest, plan: ChatPlan, prompt, params, rid: str,
                created: int, boots: list[Any] | None = None) -> JSONResponse:
    final = None
    async with contextlib.aclosing(serving.generate([prompt], [params], rid, boots=boots)) as gen:
        async for _, out in gen:
            if out.finished:
                final = out
    if final is None:
        raise APIError("the engine stopped before the request finished; retry", status=503)
    choices, completion_tokens = [], 0
    for o in sorted(final.outputs, key=lambda o: o.index):
        completion_tokens += len(o.token_ids)
        lp = chat_logprobs(serving, o, 0, params.logprobs) if params.logprobs is not None else None
        parser = ChoiceParser(plan)
        reasoning, content, calls = parser.whole(o.text)
        msg = ChatResponseMessage(content=content, reasoning_content=reasoning,
                                  tool_calls=[ToolCall(id=c.id, function=FunctionCall(name=c.name,
                                                                                      arguments=c.arguments))
                                              for c in calls])
        choices.append(ChatChoice(index=o.index, message=msg, logprobs=lp,
                                  finish_reason=parser.finish_reason(o.finish_reason),
                                  stop_reason=o.stop_reason,
                                  token_ids=list(o.token_ids) if req.return_token_ids else None))
    usage = UsageInfo.of(len(prompt), completion_tokens, final.num_cached_tokens)
    resp = ChatCompletionResponse(id=rid, created=created, model=serving.model_name, choices=choices,
                                  usage=usage,
                                  prompt_token_ids=list(prompt) if req.return_token_ids else None)
    return JSONResponse(resp.model_dump(exclude_none=False))


async def _stream(serving: Serving, req: ChatCompletionRequest, plan: ChatPlan, prompt, params, rid: str,
                  created: int, boots: list[Any] | None = None) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    parsers = {i: ChoiceParser(plan) for i in range(req.n)}
    held: dict[int, str] = {}  # reasoning not yet sent (stream_reasoning false)
    completion_tokens = cached = 0

    def chunk(choice: ChatStreamChoice, extra: dict | None = None) -> str:
        body = stream_chunk("chat.completion.chunk", rid, created, serving.model_name, [choice], None,
                            include_usage)
        return sse({**body, **(extra or {})})

    # OpenAI opens every choice with the assistant role and empty content before any token.
    first = {"prompt_token_ids": list(prompt)} if req.return_token_ids else None
    for i in range(req.n):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")), first)
    async with contextlib.aclosing(serving.generate([prompt], [params], rid, boots=boots)) as gen:
        async for _, out in gen:
            completion_tokens = sum(len(o.token_ids) for o in out.outputs)
            cached = out.num_cached_tokens
            for o in out.outputs:
                t0, k0 = sent_text.get(o.index, 0), sent_tokens.get(o.index, 0)
                if t0 < 0:
                    continue
                done = o.finish_reason is not None
                text, new_tokens = o.text[t0:], len(o.token_ids) - k0
                if text or new_tokens > 0 or done:
                    p = parsers[o.index]
                    r, c, calls = p.feed(text, final=done)
                    if not req.stream_reasoning:  # held back until the reasoning is complete
                        held[o.index] = held.get(o.index, "") + r
                        r = held.pop(o.index) if (c or calls or done) else ""
                    lp = (chat_logprobs(serving, o, k0, params.logprobs) if params.logprobs is not None
                          and new_tokens > 0 else None)
                    ids = list(o.token_ids[k0:]) if req.return_token_ids and new_tokens > 0 else None
                    if r or c or calls or lp is not None or ids:
                        delta = DeltaMessage(content=c if (c or not (r or calls)) else None,
                                             reasoning_content=r or None, tool_calls=calls or None)
                        yield chunk(ChatStreamChoice(index=o.index, delta=delta, logprobs=lp, token_ids=ids))
                    sent_text[o.index], sent_tokens[o.index] = len(o.text), len(o.token_ids)
                if done:
                    yield chunk(ChatStreamChoice(index=o.index, delta=DeltaMessage(),
                                                 finish_reason=parsers[o.index].finish_reason(o.finish_reason)))
                    sent_text[o.index] = -1
    if include_usage:
        usage = UsageInfo.of(len(prompt), completion_tokens, cached)
        yield sse(stream_chunk("chat.completion.chunk", rid, created, serving.model_name, [], usage, True))
    yield DONE
