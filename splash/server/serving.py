"""What both generation endpoints share: checks against the model, sampling params, running requests.

Everything a client can get wrong is checked here *before* a request reaches the engine, so a bad
request costs one 4xx and never a queued, half-run or wedged request. Running a request always ends
in `engine.abort` unless it finished, whichever way the handler exits (client gone, error, shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from starlette.concurrency import run_in_threadpool

from splash.engine.async_engine import EngineDeadError, EngineError
from splash.engine.outputs import RequestOutput
from splash.engine.sampling import SamplingParams, StructuredOutputs
from splash.server.errors import APIError
from splash.server.guides import control_fields
from splash.server.metrics import RequestTimer, ServerMetrics
from splash.server.protocol import ChatMessage, _SamplingFields

log = logging.getLogger("splash.server")


CLEANUP_TIMEOUT_S = 30.0
LOGPROB_FLOOR = -9999.0  # what vLLM reports for impossible tokens: JSON has no -Infinity


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finite(lp: float | None) -> float:
    """A logprob JSON can carry: -inf (and NaN, or a missing entry) become LOGPROB_FLOOR."""
    if lp is None or not math.isfinite(lp):
        return LOGPROB_FLOOR if lp is None or lp != float("inf") else 0.0
    return float(lp)


class Serving:
    """Binds an engine to a served model name; used by the route handlers of one app."""

    def __init__(self, engine: Any, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size: int | None = engine.vocab_size  # (the engine's facts: AsyncEngine's interface)
        llm = getattr(engine, "engine", engine)
        # the checkpoint's generation_config.json sampling defaults (vLLM's --generation-config auto)
        self.defaults: dict[str, Any] = dict(getattr(llm, "generation_defaults", None) or {})
        config = getattr(llm, "config", None)
        template = getattr(self.tokenizer, "chat_template", None)
        model_type = (getattr(llm, "info", None) or {}).get("model_type")
        from splash.chat.detect import detect_reasoning_parser, detect_tool_parser

        # the model's tool-call and reasoning formats: the flags, else read off its chat template
        self.tool_parser: str | None = (getattr(config, "tool_call_parser", None)
                                        or detect_tool_parser(template, model_type))
        self.reasoning_parser: str | None = (getattr(config, "reasoning_parser", None)
                                             or detect_reasoning_parser(template, model_type))
        self.grammar_enabled = getattr(config, "grammar_backend", "xgrammar") != "none"
        from splash.server.pd import role_for

        self.pd: Any = role_for(engine)  # prefill/decode disaggregation: this server's half (None: colocated)

    # ---- checks ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           status=404, param="model", code="model_not_found")

    def check_supported(self, req: _SamplingFields) -> None:
        for param, reason in req.unsupported():
            raise APIError(reason, param=param, code="unsupported_parameter")

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise APIError(f"'{param}' is empty; send at least one token", param=param,
                           code="empty_prompt")
        if self.vocab_size is not None:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(f"token id {bad} in '{param}' is outside the vocabulary [0, "
                               f"{self.vocab_size})", param=param, code="invalid_token_id")

    def max_tokens_for(self, prompt_len: int, requested: int | None, param: str) -> int:
        """The generation budget: refuse what can never fit the context or the KV pool."""
        ctx = self.max_model_len
        pool = self.engine.max_request_tokens  # (DP layouts bound a request by its owner's pool)
        if prompt_len >= ctx:
            raise APIError(
                f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.",
                param="prompt" if param == "max_tokens" else "messages", code="context_length_exceeded")
        if pool is not None and prompt_len >= pool:
            raise APIError(
                f"The prompt has {prompt_len} tokens but the whole KV cache holds {pool}; it can never "
                f"be scheduled. Shorten the prompt or start the server with more --memory-per-rank.",
                param="prompt" if param == "max_tokens" else "messages", code="kv_pool_exceeded")
        # Each of the n sequences holds its own KV (no prefix sharing); the scheduler can run them one
        # after another, so only a single sequence that outgrows the whole pool can never finish.
        room = ctx - prompt_len
        room_pool = pool - prompt_len if pool is not None else room
        if requested is None:
            return min(room, room_pool)
        if requested > room:
            raise APIError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                f"completion). Reduce the prompt or {param}.", param=param,
                code="context_length_exceeded")
        if requested > room_pool:
            raise APIError(
                f"{prompt_len} prompt + {requested} generated tokens need {prompt_len + requested} KV "
                f"slots but the whole KV cache holds {pool}; the request could never finish. Reduce "
                f"{param} or the prompt, or give the server more --memory-per-rank.", param=param,
                code="kv_pool_exceeded")
        return requested

    def sampling_params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured: StructuredOutputs | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        d = self.defaults
        top_k = req.top_k if req.top_k is not None else int(d.get("top_k", -1))
        if self.vocab_size is not None and top_k > self.vocab_size:
            top_k = -1  # every token: the same distribution as "disabled"
        stop_ids = list(req.stop_token_ids or [])
        if self.vocab_size is not None:
            bad = next((t for t in stop_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(f"stop_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids", code="invalid_value")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise APIError("stop strings must be non-empty", param="stop", code="invalid_value")
        if req.min_tokens > max_tokens:
            raise APIError(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})",
                           param="min_tokens", code="invalid_value")
        try:
            return SamplingParams(
                n=req.n,
                temperature=float(d.get("temperature", 1.0)) if req.temperature is None else req.temperature,
                top_p=float(d.get("top_p", 1.0)) if req.top_p is None else req.top_p,
                top_k=top_k,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=stop,
                stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=(req.skip_special_tokens if skip_special_tokens is None
                                     else skip_special_tokens),
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured,
                **control_fields(req, self.vocab_size, d),
            )
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(" ", 1)[0], code="invalid_value") from None

    # ---- prompts --------------------------------------------------------------------------------
    async def completion_prompts(self, prompt: Any) -> list[list[int]]:
        """A string, strings, token ids or lists of token ids -> one id list per prompt."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError("'prompt' is empty; send a string or token ids", param="prompt",
                           code="empty_prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        if any(not t for t in texts):
            raise APIError("'prompt' holds an empty string", param="prompt", code="empty_prompt")
        encoded = iter(await run_in_threadpool(lambda: [self.encode(t) for t in texts]) if texts else [])
        out = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for ids in out:
            self.check_ids(ids, "prompt")
        return out

    def messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The conversation as the template sees it: each message whole (tool_calls, tool_call_id,
        reasoning_content, name and any other key the client sent), text parts joined."""
        conv = []
        for i, m in enumerate(messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                parts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise APIError(f"content part of type {part.type!r} is not supported; only text",
                                       param=f"messages[{i}].content[{j}].type", code="unsupported_content")
                    parts.append(part.text)
                msg["content"] = "".join(parts)
            elif m.content is None and not m.tool_calls:
                msg["content"] = ""
            conv.append(msg)
        return conv

    async def chat_prompt(self, req: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat request's prompt ids: its messages, tools, template (the request's, else the
        server's) and template variables, rendered as transformers renders them."""
        conv = self.messages(req.messages)
        kw = dict(getattr(req, "chat_template_kwargs", None) or {})
        if getattr(req, "continue_final_message", False):
            if conv[-1]["role"] != "assistant":
                raise APIError("continue_final_message needs the last message to be the assistant's",
                               param="continue_final_message", code="invalid_value")
            asked = "add_generation_prompt" in req.model_fields_set
            if asked and getattr(req, "add_generation_prompt", True):
                raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message", code="invalid_value")
        opts = {"tools": tools, "chat_template": getattr(req, "chat_template", None),
                "continue_final_message": bool(getattr(req, "continue_final_message", False)), **kw}
        add = bool(getattr(req, "add_generation_prompt", True)) and not opts["continue_final_message"]
        try:
            ids = await run_in_threadpool(self.apply_chat_template, conv, add, opts)
        except APIError:
            raise
        except Exception as e:  # a template that rejects this conversation (e.g. role order)
            raise APIError(f"the chat template rejected the messages: {e}", param="messages",
                           code="invalid_messages") from None
        self.check_ids(ids, "messages")
        return ids

    def special_ids(self, text: str) -> list[int]:
        """The token ids of a marker such as `</think>` (one added token in the formats that use it)."""
        tok = self.tokenizer
        try:
            return list(tok.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tok.encode(text))

    async def compile_guide(self, spec: Any, param: str) -> None:
        """Compile a structured-output constraint up front (a bad one: 400 naming `param`)."""
        if not self.grammar_enabled:
            raise APIError("structured outputs are off on this server (--grammar-backend none)", param=param,
                           code="unsupported_parameter")
        from splash.server.guides import compile_guide

        await compile_guide(self.engine, spec, param)

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer; send the prompt as token ids", param="prompt",
                           code="no_tokenizer")
        try:
            return list(tok.encode(text, add_special_tokens=True))
        except TypeError:
            return list(tok.encode(text))

    def apply_chat_template(self, conv: list[dict[str, Any]], add_generation_prompt: bool,
                            opts: dict[str, Any] | None = None) -> list[int]:
        if not hasattr(self.tokenizer, "apply_chat_template"):
            raise APIError("this model has no tokenizer with a chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        opts = {k: v for k, v in (opts or {}).items() if v is not None and v is not False}
        out = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **opts)
        if isinstance(out, str):
            return self.encode(out)
        if isinstance(out, dict):  # transformers-style BatchEncoding
            out = out["input_ids"]
        return list(out)

    def token_str(self, tid: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{tid}"
        try:
            return self.tokenizer.decode([tid], skip_special_tokens=False)
        except TypeError:
            return self.tokenizer.decode([tid])

    # ---- running --------------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: list[SamplingParams], base_id: str,
                       ids: list[str] | None = None, boots: list[Any] | None = None
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt; yield (prompt index, snapshot) as they arrive. `ids`
        names the engine requests (the native API's `rid`), else they derive from `base_id`; `boots`
        (splash/server/pd.py `bootstraps`) each prompt's prefill/decode bootstrap, if any.

        On any exit before all finish (client gone, error, cancellation) every unfinished request is
        aborted, which frees its KV pages.
        """
        if ids is None:
            ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        for p in prompts:
            self.metrics.prompt_tokens.inc(len(p))
        boots = boots if boots is not None and self.pd is not None else [None] * len(prompts)
        if len(prompts) == 1:
            async with contextlib.aclosing(self._one(prompts[0], params[0], ids[0], boots[0])) as g:
                async for out in g:
                    yield 0, out
            return
        # Bounded: when the client stops reading, the pumps stop too and each request's mailbox in the
        # engine keeps only its newest snapshot (an unbounded queue here would keep every step's).
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(len(prompts))

        async def pump(i: int) -> None:
            try:
                async with contextlib.aclosing(self._one(prompts[i], params[i], ids[i], boots[i])) as g:
                    async for out in g:
                        await queue.put((i, out))
                await queue.put((i, None))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer, which re-raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        try:
            live = len(tasks)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            with _shielded():
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, prompt: list[int], params: SamplingParams, rid: str, boot: Any = None
                   ) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(self.metrics)
        finished = False
        if boot is not None:  # this server's half of a disaggregated request
            from splash.server.pd import run

            gen = run(self.pd, prompt, params, rid, boot)
        else:
            gen = self.engine.generate(prompt, params, rid)
        try:
            async for out in gen:
                timer.tokens_seen(sum(len(o.token_ids) for o in out.outputs))
                if out.finished:
                    finished = True
                    timer.done([o.finish_reason for o in out.outputs])
                yield out
                if finished:
                    break
        except ValueError as e:  # the engine refused the request (a check we do not duplicate here)
            raise APIError(str(e), code="invalid_request") from None
        except EngineDeadError as e:
            raise APIError(f"{e}; the server is shutting down", status=503, code="engine_dead") from None
        except EngineError as e:
            raise APIError(str(e), status=500, type="server_error", code="engine_error") from None
        finally:
            if not finished:
                timer.done(["abort"])
            # Starlette cancels a streaming response through an anyio scope, which cancels every
            # await inside it again; the cleanup must run to the end or pages would stay taken.
            with _shielded():
                with contextlib.suppress(Exception):
                    await gen.aclose()
                if not finished:
                    try:
                        await self.engine.abort(rid)  # returns once the engine has freed the pages
                    except Exception:  # already gone is fine; anything else is worth a log line
                        log.debug("abort of %s failed", rid, exc_info=True)


def _shielded() -> anyio.CancelScope:
    """Protect cleanup from re-cancellation, but never wait on a stuck engine forever."""
    scope = anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True)
    return scope
