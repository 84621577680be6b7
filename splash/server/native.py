"""SGLang's native API next to the OpenAI one: /generate, abort, pause/continue, server and model info.

RL frameworks (slime, verl's HTTP rollout, AReaL) drive SGLang through these routes: token ids in and
out with each token's logprob, abort of one or all requests (each aborted response still ends with
HTTP 200, the tokens it had and finish reason `abort`), and pause/continue around weight updates.
Shapes follow SGLang: a single prompt with n = 1 answers one object `{text, output_ids, meta_info}`;
a batch or n > 1 answers a list, prompt-major (index = prompt * n + sample). So do the values slime
trains on: logprobs of the distribution drawn from (temperature applied), renormalised over the kept set
with `custom_params.return_top_p_token_ids` (whose ids/offsets come base64 int32), routed experts of
every layer, input logprobs from `logprob_start_len`. The bodies are built by plain functions
(`batch`, `result`, `objects`, `abort`, `pause`, ...) so `splash.Engine` returns the same ones.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from splash.engine.outputs import CompletionOutput, RequestOutput
from splash.engine.sampling import SamplingParams
from splash.server.errors import APIError
from splash.server.guides import control_fields, structured_from
from splash.server.native_protocol import AbortRequest, GenerateRequest, NativeSamplingParams, PauseRequest
from splash.server.pd import bootstraps
from splash.server.serving import Serving, finite
from splash.server.streaming import DONE, sse, sse_response, until_disconnect

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 30.0


def _listify(v: Any, n: int, name: str) -> list[Any]:
    if isinstance(v, list):
        if len(v) != n:
            raise APIError(f"'{name}' lists {len(v)} entries for {n} prompts", param=name)
        return v
    return [v] * n


class _Batch:
    """One /generate call resolved: prompts, per-prompt engine params and request ids."""

    def __init__(self, serving: Serving, req: GenerateRequest, prompts: list[list[int]], batched: bool
                 ) -> None:
        self.serving, self.req, self.prompts, self.batched = serving, req, prompts, batched
        n = len(prompts)
        sps = _listify(req.sampling_params or NativeSamplingParams(), n, "sampling_params")
        self.want_lp = [bool(x) for x in _listify(req.return_logprob, n, "return_logprob")]
        self.top = [int(x) for x in _listify(req.top_logprobs_num, n, "top_logprobs_num")]
        starts = [int(x) for x in _listify(req.logprob_start_len, n, "logprob_start_len")]
        if any(x < -1 for x in starts):
            raise APIError("logprob_start_len must be -1 (no input logprobs) or a prompt position >= 0",
                           param="logprob_start_len")
        # input_token_logprobs from that position on, only where logprobs are asked for (as SGLang)
        self.starts = [x if lp else -1 for x, lp in zip(starts, self.want_lp)]
        if req.return_routed_experts:
            short = next((len(p) for p in prompts if req.routed_experts_start_len > len(p)), None)
            if short is not None:
                raise APIError(f"routed_experts_start_len ({req.routed_experts_start_len}) exceeds the "
                               f"prompt ({short} tokens)", param="routed_experts_start_len")
        if req.token_ids_logprob:
            raise APIError("token_ids_logprob is not supported", param="token_ids_logprob")
        for name, neutral in (("return_hidden_states", False), ("lora_path", None), ("image_data", None),
                              ("session_params", None), ("custom_logit_processor", None),
                              ("background", False), ("return_bytes", False), ("return_entropy", False)):
            if getattr(req, name) not in (neutral, None):
                raise APIError(f"{name} is not supported", param=name, code="unsupported_parameter")
        self.sampling = sps
        self.guide_params: list[str | None] = [None] * n
        self.params_made = 0
        self.params = [self._params(p, sp, lp, k, st)
                       for p, sp, lp, k, st in zip(prompts, sps, self.want_lp, self.top, self.starts)]
        self.n = [p.n for p in self.params]
        if req.rid is None:
            self.ids = [uuid.uuid4().hex for _ in prompts]
        elif isinstance(req.rid, str):
            if n != 1:
                raise APIError(f"'rid' must list one id per prompt ({n} prompts)", param="rid")
            self.ids = [req.rid]
        else:
            self.ids = _listify(req.rid, n, "rid")
        if len(set(self.ids)) != len(self.ids) or any(not i for i in self.ids):
            raise APIError("request ids ('rid') must be unique and non-empty", param="rid")
        self.boots = bootstraps(req, n)  # prefill/decode disaggregation (splash/server/pd.py)
        self.t0 = time.time()

    def _params(self, prompt: list[int], sp: NativeSamplingParams, want_lp: bool, k: int, start: int
                ) -> SamplingParams:
        s = self.serving
        for param, reason in sp.unsupported():
            raise APIError(reason, param=f"sampling_params.{param}", code="unsupported_parameter")
        if not 0 <= k <= 20:
            raise APIError(f"top_logprobs_num must be in [0, 20], got {k}", param="top_logprobs_num")
        if sp.max_new_tokens is None:
            room = s.max_tokens_for(len(prompt), None, "sampling_params.max_new_tokens")
            max_tokens = min(DEFAULT_MAX_NEW_TOKENS, room)
        else:
            max_tokens = s.max_tokens_for(len(prompt), sp.max_new_tokens, "sampling_params.max_new_tokens")
        stop_ids = list(sp.stop_token_ids or [])
        if s.vocab_size is not None:
            bad = next((t for t in stop_ids if not 0 <= t < s.vocab_size), None)
            if bad is not None:
                raise APIError(f"stop_token_ids holds {bad}, outside the vocabulary [0, {s.vocab_size})",
                               param="sampling_params.stop_token_ids")
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        if any(not x for x in stop):
            raise APIError("stop strings must be non-empty", param="sampling_params.stop")
        if stop and s.tokenizer is None:
            raise APIError("stop strings need a tokenizer; this model has none: use stop_token_ids",
                           param="sampling_params.stop")
        top_k = sp.top_k if s.vocab_size is None or sp.top_k <= s.vocab_size else -1
        structured, param = structured_from(sp, "sampling_params.")
        if structured is not None:
            self.guide_params[self.params_made] = param.removeprefix("sampling_params.") if param else None
        self.params_made += 1
        try:
            return SamplingParams(
                n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=top_k,
                seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
                max_tokens=max_tokens, min_tokens=min(sp.min_new_tokens, max_tokens), stop=stop,
                stop_token_ids=stop_ids, ignore_eos=sp.ignore_eos, logprobs=k if want_lp else None,
                skip_special_tokens=sp.skip_special_tokens,
                return_routed_experts=self.req.return_routed_experts,
                # SGLang's logprobs are of the distribution drawn from (temperature applied)
                logprob_temperature=True, return_top_p_token_ids=sp.return_top_p_token_ids,
                prompt_logprobs=k if start >= 0 else None, prompt_logprobs_start=max(start, 0),
                structured_outputs=structured,
                **control_fields(sp, s.vocab_size, s.defaults, "sampling_params."))
        except ValueError as e:
            raise APIError(str(e), param="sampling_params", code="invalid_value") from None

    # ---- response objects -----------------------------------------------------------------------
    def obj(self, i: int, ro: RequestOutput, o: CompletionOutput, weight_version: str) -> dict[str, Any]:
        """SGLang's `{text, output_ids, meta_info}` for sample `o` of prompt `i`."""
        sp = self.sampling[i]
        text = o.text
        if o.finish_reason == "stop" and isinstance(o.stop_reason, str) and sp.no_stop_trim:
            text += o.stop_reason
        meta: dict[str, Any] = {
            "id": self.ids[i], "finish_reason": _finish(o), "prompt_tokens": len(ro.prompt_token_ids),
            "completion_tokens": len(o.token_ids), "cached_tokens": ro.num_cached_tokens,
            "weight_version": weight_version,
            "e2e_latency": time.time() - self.t0}
        if o.spec_verify_ct:  # SGLang's: verify steps, and tokens per verify step (1 + accepted drafts)
            meta["spec_verify_ct"] = o.spec_verify_ct
            meta["spec_accept_length"] = len(o.token_ids) / o.spec_verify_ct
        if self.want_lp[i]:
            # one entry per generated token, always a number: the engine keeps a logprob with every token
            lps = o.logprobs or []
            meta["output_token_logprobs"] = [self._entry(d.get(t), t) for d, t in zip(lps, o.token_ids,
                                                                                     strict=True)]
            if self.top[i]:
                meta["output_top_logprobs"] = [self._top(d, self.top[i]) for d in lps]
            if self.starts[i] >= 0:  # the prompt's, from logprob_start_len on; position 0 has none (null)
                pl, ids = (ro.prompt_logprobs or [])[self.starts[i]:], ro.prompt_token_ids[self.starts[i]:]
                meta["input_token_logprobs"] = [[None, t, self._text(t)] if d is None else
                                                self._entry(d.get(t), t) for d, t in zip(pl, ids)]
                if self.top[i]:
                    meta["input_top_logprobs"] = [None if d is None else self._top(d, self.top[i])
                                                  for d in pl]
        if o.top_p_token_ids is not None and o.finish_reason is not None:
            ids, offsets = _flatten(o.top_p_token_ids)
            meta["top_p_token_ids"], meta["top_p_token_offsets"] = _b64(ids), _b64(offsets)
        if self.req.return_routed_experts and o.routed_experts is not None:
            got = self._routed(o.routed_experts, len(ro.prompt_token_ids) + len(o.token_ids) - 1)
            if got is not None:
                meta["routed_experts"], meta["routed_experts_shape"] = got
                meta["routed_experts_start_len"] = self.req.routed_experts_start_len
        out = {"text": text, "output_ids": list(o.token_ids), "meta_info": meta}
        if self.batched or self.n[i] > 1:
            out["index"] = sum(self.n[:i]) + o.index
        return out

    def _text(self, t: int) -> str | None:
        return self.serving.token_str(t) if self.req.return_text_in_logprobs else None

    def _entry(self, lp: float | None, t: int) -> list[Any]:
        return [finite(lp), t, self._text(t)]

    def _top(self, d: dict[int, float], k: int) -> list[list[Any]]:
        return [self._entry(v, t) for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]]

    def _routed(self, ids: Any, rows: int) -> tuple[str, list[int]] | None:
        """SGLang's routed experts: every layer x top-k per position in [start, rows), base64 int32; None
        when the positions recorded do not cover that (aborted before its prefill ended)."""
        from splash.engine.routing import every_layer
        from splash.server.server_info import model_facts

        if ids.shape[0] != rows:
            return None
        f = model_facts(self.serving.engine)
        arr = every_layer(ids, f["moe_layers"], f["num_layers"])[self.req.routed_experts_start_len:]
        arr = arr.contiguous().numpy()
        return base64.b64encode(arr.tobytes()).decode("ascii"), list(arr.shape)


def _flatten(rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per-token id lists -> (all ids, offsets from 0): token i's are ids[offsets[i]:offsets[i + 1]]."""
    ids, offsets = [], [0]
    for r in rows:
        ids += r
        offsets.append(len(ids))
    return ids, offsets


def _b64(values: list[int]) -> str:
    import numpy as np

    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def _finish(o: CompletionOutput) -> dict[str, Any] | None:
    r = o.finish_reason
    if r is None:
        return None
    if r == "length":
        return {"type": "length", "length": len(o.token_ids)}
    if r == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    matched = o.stop_reason if o.stop_reason is not None else (o.token_ids[-1] if o.token_ids else None)
    return {"type": "stop", "matched": matched}


async def _prompts(serving: Serving, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise APIError("send exactly one of 'text' and 'input_ids'", param="text")
    if req.input_ids is not None:
        ids = req.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batched else [list(ids)]
        if not prompts:
            raise APIError("'input_ids' is an empty batch", param="input_ids", code="empty_prompt")
        for p in prompts:
            serving.check_ids(p, "input_ids")
        return prompts, batched
    texts = [req.text] if isinstance(req.text, str) else list(req.text)
    if not texts or any(not t for t in texts):
        raise APIError("'text' is empty", param="text", code="empty_prompt")
    enc = await run_in_threadpool(lambda: [serving.encode(t) for t in texts])
    for p in enc:
        serving.check_ids(p, "text")
    return enc, not isinstance(req.text, str)


async def generate(serving: Serving, req: GenerateRequest, request: Request) -> Response:
    b = await batch(serving, req)
    if req.stream:
        return sse_response(_sse(objects(b)))
    return await until_disconnect(request, _full(b))


async def batch(serving: Serving, req: GenerateRequest) -> _Batch:
    """A /generate body checked and resolved (every bad input raises APIError before anything runs)."""
    serving.check_model(req.model)
    prompts, batched = await _prompts(serving, req)
    b = _Batch(serving, req, prompts, batched)
    for i, p in enumerate(b.params):  # a bad schema, regex or grammar: 400 before anything is queued
        if p.structured_outputs is not None:
            await serving.compile_guide(p.structured_outputs, f"sampling_params.{b.guide_params[i]}")
    return b


async def result(b: _Batch) -> dict[str, Any] | list[dict[str, Any]]:
    """The finished response body: one object, or a list for a batch or n > 1 (splash.Engine returns it)."""
    final: dict[int, RequestOutput] = {}
    gen_ = b.serving.generate(b.prompts, b.params, "", ids=b.ids, boots=b.boots)
    async with contextlib.aclosing(gen_) as gen:
        async for i, out in gen:
            if out.finished:
                final[i] = out
    version = b.serving.engine.weight_version
    objs = [b.obj(i, final[i], o, version) for i in range(len(b.prompts)) for o in final[i].outputs]
    return objs if (b.batched or len(objs) > 1) else objs[0]


async def _full(b: _Batch) -> JSONResponse:
    return JSONResponse(await result(b))


async def objects(b: _Batch) -> AsyncIterator[dict[str, Any]]:
    """The streamed objects: cumulative, one whenever a sequence grew or finished."""
    sent: dict[tuple[int, int], tuple[int, bool]] = {}
    gen_ = b.serving.generate(b.prompts, b.params, "", ids=b.ids, boots=b.boots)
    async with contextlib.aclosing(gen_) as gen:
        async for i, out in gen:
            for o in out.outputs:
                state = (len(o.token_ids), o.finish_reason is not None)
                if sent.get((i, o.index)) == state:
                    continue
                sent[(i, o.index)] = state
                yield b.obj(i, out, o, b.serving.engine.weight_version)


async def _sse(objs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async with contextlib.aclosing(objs) as it:
        async for o in it:
            yield sse(o)
    yield DONE


# ---- the other native routes (their bodies, which splash.Engine returns too) ----------------------------
def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


async def abort(engine: Any, req: AbortRequest) -> dict[str, Any]:
    """Abort one request, several, or all: each aborted response ends with its tokens and finish abort."""
    if req.abort_all:
        n = await engine.abort_all()
        return _ok(f"aborted {n} requests", num_aborted=n)
    rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
    if not any(rids):
        raise APIError("give 'rid' (a request id or a list of them) or 'abort_all': true", param="rid")
    for rid in rids:
        await engine.abort(rid)
    return _ok(f"aborted {', '.join(rids)} (ids not running are ignored)")


async def pause(engine: Any, mode: str) -> dict[str, Any]:
    try:
        n = await engine.pause_generation(mode)
    except ValueError as e:
        raise APIError(str(e), param="mode") from None
    return _ok(f"generation paused ({mode}); {n} requests affected", num_paused_requests=n)


async def resume(engine: Any) -> dict[str, Any]:
    await engine.continue_generation()
    return _ok("generation continues")


async def flush(engine: Any) -> tuple[int, dict[str, Any]]:
    """(200, body) once flushed; (400, body) while running requests hold KV (clients such as slime retry)."""
    try:
        await engine.call(lambda e: e.flush_cache())
    except ValueError as e:
        return 400, {"success": False, "message": str(e)}
    return 200, _ok("Cache flushed.")


def install(app: FastAPI, serving: Serving, engine: Any, model_name: str,
            launch: dict[str, Any] | None = None) -> None:
    """Add the native routes to `app` (every one needs the API key when the server has one); `launch`:
    how the server was started (host, port), for the server info."""
    from splash.server import server_info

    r = APIRouter()

    @r.post("/generate")
    async def generate_route(req: GenerateRequest, request: Request) -> Response:
        return await generate(serving, req, request)

    @r.post("/abort_request")
    async def abort_request(req: AbortRequest) -> JSONResponse:
        return JSONResponse(await abort(engine, req))

    @r.post("/pause_generation")
    async def pause_generation(req: PauseRequest) -> JSONResponse:
        return JSONResponse(await pause(engine, req.mode))

    @r.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        return JSONResponse(await resume(engine))

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        status, body = await flush(engine)
        return JSONResponse(body, status_code=status)

    @r.get("/get_server_info")
    @r.get("/server_info")
    async def get_server_info() -> JSONResponse:
        stats = await run_in_threadpool(engine.stats)
        info = server_info.server_info(engine, stats, model_name, launch)
        info.update(tool_call_parser=serving.tool_parser, reasoning_parser=serving.reasoning_parser,
                    grammar_backend="xgrammar" if serving.grammar_enabled else None)
        return JSONResponse(info)

    @r.get("/v1/loads")
    async def v1_loads(include: str | None = None) -> JSONResponse:
        stats = await run_in_threadpool(engine.stats)
        return JSONResponse(server_info.loads(stats, include))

    @r.get("/get_load")
    async def get_load() -> JSONResponse:
        stats = await run_in_threadpool(engine.stats)
        return JSONResponse(server_info.get_load(stats))

    @r.get("/get_model_info")
    @r.get("/model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse({"model_path": str(getattr(engine, "model_name", model_name)),
                             "tokenizer_path": str(getattr(engine, "model_name", model_name)),
                             "served_model_name": model_name, "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": engine.weight_version,
                             "max_model_len": serving.max_model_len, "vocab_size": serving.vocab_size})

    @r.get("/get_weight_version")
    async def get_weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": engine.weight_version})

    @r.get("/health_generate")
    async def health_generate() -> Response:
        if not getattr(engine, "is_healthy", True):
            return APIError("engine is not running", status=503, code="engine_dead").response()
        if engine.is_paused:
            return APIError("generation is paused or its memory is released", status=503,
                            code="engine_paused").response()
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        async def one() -> None:
            async for _ in engine.generate([0], params, f"health-{uuid.uuid4().hex}"):
                pass

        try:
            await asyncio.wait_for(one(), HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            return APIError(f"generation failed: {type(e).__name__}: {e}", status=503,
                            code="engine_unhealthy").response()
        return Response(status_code=200)

    app.include_router(r)
