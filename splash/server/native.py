"""SGLang's native API next to the OpenAI one: /generate, abort, pause/continue, server and model info.

RL frameworks (slime, verl's HTTP rollout, AReaL) drive SGLang through these routes: token ids in and
out with each token's logprob, abort of one or all requests (each aborted response still ends with
HTTP 200, the tokens it had and finish reason `abort`), and pause/continue around weight updates.
Shapes follow SGLang: a single prompt with n = 1 answers one object `{text, output_ids, meta_info}`;
a batch or n > 1 answers a list, prompt-major (index = prompt * n + sample).
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
from splash.server.native_protocol import AbortRequest, GenerateRequest, NativeSamplingParams, PauseRequest
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
        starts = _listify(req.logprob_start_len, n, "logprob_start_len")
        if any(s != -1 for s in starts):
            raise APIError("prompt logprobs are not supported: send logprob_start_len -1 (only the "
                           "generated tokens' logprobs are returned)", param="logprob_start_len")
        if req.token_ids_logprob:
            raise APIError("token_ids_logprob is not supported", param="token_ids_logprob")
        for name, neutral in (("return_hidden_states", False), ("lora_path", None), ("image_data", None),
                              ("session_params", None), ("custom_logit_processor", None)):
            if getattr(req, name) not in (neutral, None):
                raise APIError(f"{name} is not supported", param=name, code="unsupported_parameter")
        self.sampling = sps
        self.params = [self._params(p, sp, lp, k)
                       for p, sp, lp, k in zip(prompts, sps, self.want_lp, self.top)]
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
        self.t0 = time.time()

    def _params(self, prompt: list[int], sp: NativeSamplingParams, want_lp: bool, k: int) -> SamplingParams:
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
        try:
            return SamplingParams(
                n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=top_k,
                seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
                max_tokens=max_tokens, min_tokens=min(sp.min_new_tokens, max_tokens), stop=stop,
                stop_token_ids=stop_ids, ignore_eos=sp.ignore_eos, logprobs=k if want_lp else None,
                skip_special_tokens=sp.skip_special_tokens,
                return_routed_experts=self.req.return_routed_experts)
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
        if self.want_lp[i]:
            words = self.req.return_text_in_logprobs
            lps = o.logprobs or []
            meta["output_token_logprobs"] = [
                [finite(lps[j].get(t)) if j < len(lps) else None, t, self._word(t) if words else None]
                for j, t in enumerate(o.token_ids)]
            if self.top[i]:
                meta["output_top_logprobs"] = [
                    [[finite(v), t, self._word(t) if words else None]
                     for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:self.top[i]]] for d in lps]
        if self.req.return_routed_experts and o.routed_experts is not None:
            arr = o.routed_experts.contiguous().numpy()
            meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode("ascii")
            meta["routed_experts_shape"] = list(arr.shape)
        out = {"text": text, "output_ids": list(o.token_ids), "meta_info": meta}
        if self.batched or self.n[i] > 1:
            out["index"] = sum(self.n[:i]) + o.index
        return out

    def _word(self, t: int) -> str:
        return self.serving.token_str(t)


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
    prompts, batched = await _prompts(serving, req)
    b = _Batch(serving, req, prompts, batched)
    eng = serving.engine
    if req.stream:
        return sse_response(_stream(b, eng))
    return await until_disconnect(request, _full(b, eng))


async def _full(b: _Batch, eng: Any) -> JSONResponse:
    final: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(b.serving.generate(b.prompts, b.params, "", ids=b.ids)) as gen:
        async for i, out in gen:
            if out.finished:
                final[i] = out
    version = eng.weight_version
    objs = [b.obj(i, final[i], o, version) for i in range(len(b.prompts)) for o in final[i].outputs]
    return JSONResponse(objs if (b.batched or len(objs) > 1) else objs[0])


async def _stream(b: _Batch, eng: Any) -> AsyncIterator[str]:
    sent: dict[tuple[int, int], tuple[int, bool]] = {}
    async with contextlib.aclosing(b.serving.generate(b.prompts, b.params, "", ids=b.ids)) as gen:
        async for i, out in gen:
            for o in out.outputs:
                state = (len(o.token_ids), o.finish_reason is not None)
                if sent.get((i, o.index)) == state:
                    continue
                sent[(i, o.index)] = state
                yield sse(b.obj(i, out, o, eng.weight_version))
    yield DONE


# ---- the other native routes -------------------------------------------------------------------------
def _ok(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def install(app: FastAPI, serving: Serving, engine: Any, model_name: str) -> None:
    """Add the native routes to `app` (every one needs the API key when the server has one)."""
    r = APIRouter()

    @r.post("/generate")
    async def generate_route(req: GenerateRequest, request: Request) -> Response:
        return await generate(serving, req, request)

    @r.post("/abort_request")
    async def abort_request(req: AbortRequest) -> JSONResponse:
        if req.abort_all:
            n = await engine.abort_all()
            return _ok(f"aborted {n} requests", num_aborted=n)
        rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
        if not any(rids):
            raise APIError("give 'rid' (a request id or a list of them) or 'abort_all': true", param="rid")
        for rid in rids:
            await engine.abort(rid)
        return _ok(f"aborted {', '.join(rids)} (ids not running are ignored)")

    @r.post("/pause_generation")
    async def pause_generation(req: PauseRequest) -> JSONResponse:
        try:
            n = await engine.pause_generation(req.mode)
        except ValueError as e:
            raise APIError(str(e), param="mode") from None
        return _ok(f"generation paused ({req.mode}); {n} requests affected", num_paused_requests=n)

    @r.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await engine.continue_generation()
        return _ok("generation continues")

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        try:
            await engine.call(lambda e: e.flush_cache())
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return _ok("Cache flushed.")

    @r.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        from splash import __version__

        stats = await run_in_threadpool(engine.stats)
        info = {**stats, "model_path": str(getattr(engine, "model_name", model_name)),
                "served_model_name": model_name, "tp_size": stats.get("ranks", 1),
                "weight_version": engine.weight_version, "version": __version__,
                "internal_states": [stats]}
        return JSONResponse(info)

    @r.get("/get_model_info")
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
