"""`splash.Engine`: an in-process engine with SGLang's `Engine` shape, for verl-style RL loops.

Trainers that hold an `sglang.Engine` call `generate` / `async_generate` with `input_ids` and a
`sampling_params` dict, then `release_memory_occupation`, train, `resume_memory_occupation`,
`update_weights_from_tensor` and `flush_cache`. This class answers those calls with the bodies the HTTP
server returns (the same code builds them: splash/server/native.py and weights.py), so a loop can move
between `splash serve` and this object unchanged; bad input raises ValueError with the message the
server would answer with a 400. vLLM's shape (`LLM`) is splash/llm.py.

The engine steps on its own thread (splash/engine/async_engine.py); the synchronous methods run their
work on a private event loop, `async_generate` on the caller's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from splash.server.errors import APIError

Prompts = str | list[str] | None
Ids = list[int] | list[list[int]] | None
Sampling = dict[str, Any] | list[dict[str, Any]] | None
PerPrompt = int | list[int] | None
Body = dict[str, Any] | list[dict[str, Any]]

class Engine:
    """`Engine(model_path=..., tp_size=..., enable_memory_saver=...)` and SGLang's methods.

    Other keywords are the engine's options (`splash.config.EngineConfig`: dtype, layout, num_kv_pages,
    memory_per_rank, device, ...; SGLang's ServerArgs names such as tp_size are taken too).
    `enable_memory_saver` (SGLang's flag, off by default as there)
    allows `release_memory_occupation`."""

    def __init__(self, model: str | None = None, *, enable_memory_saver: bool = False,
                 served_model_name: str | None = None, **kw: Any) -> None:
        from splash.config import EngineConfig
        from splash.engine.async_engine import AsyncEngine
        from splash.server.metrics import ServerMetrics
        from splash.server.serving import Serving

        if model is not None:
            kw["model"] = model
        # one config (SGLang's names accepted: model_path, tp_size, ...; unknown keys refused)
        config = EngineConfig.from_kwargs(enable_memory_saver=enable_memory_saver, **kw)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splash-engine-api", daemon=True)
        self._thread.start()
        try:
            self._engine = AsyncEngine.from_config(config)
        except BaseException:
            self._stop_loop()
            raise
        self.model_name = served_model_name or str(config.model)
        self._serving = Serving(self._engine, self.model_name, ServerMetrics(self.model_name))
        self._engine.start()
        self._closed = False

    # ---- generation -------------------------------------------------------------------------------
    def _request(self, prompt: Any, sampling_params: Any, input_ids: Any, kw: dict[str, Any]) -> Any:
        from pydantic import ValidationError

        from splash.server.native_protocol import GenerateRequest

        body = {k: v for k, v in kw.items() if v is not None}
        try:
            return GenerateRequest(text=prompt, input_ids=input_ids, sampling_params=sampling_params, **body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise ValueError(f"invalid value for '{where}': {first.get('msg')}") from None

    def generate(self, prompt: Prompts = None, sampling_params: Sampling = None, input_ids: Ids = None,
                 return_logprob: bool | list[bool] = False, logprob_start_len: PerPrompt = None,
                 top_logprobs_num: PerPrompt = None, stream: bool = False, rid: str | list[str] | None = None,
                 return_routed_experts: bool = False, **kw: Any) -> Body | Iterator[dict[str, Any]]:
        """SGLang's `Engine.generate`: the /generate body (one object, or a list for a batch or n > 1); with
        `stream`, an iterator of the cumulative objects. Leaving the iteration early aborts."""
        from splash.server import native

        req = self._request(prompt, sampling_params, input_ids, dict(
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, rid=rid, return_routed_experts=return_routed_experts,
            stream=stream, **kw))
        b = self._run(native.batch(self._serving, req))
        if not stream:
            return self._run(native.result(b))
        return self._iterate(native.objects(b))

    async def async_generate(self, prompt: Prompts = None, sampling_params: Sampling = None,
                             input_ids: Ids = None, return_logprob: bool | list[bool] = False,
                             logprob_start_len: PerPrompt = None, top_logprobs_num: PerPrompt = None,
                             stream: bool = False, rid: str | list[str] | None = None,
                             return_routed_experts: bool = False, **kw: Any
                             ) -> Body | AsyncIterator[dict[str, Any]]:
        """`generate` on the caller's event loop (many may run concurrently: they batch in the engine)."""
        from splash.server import native

        req = self._request(prompt, sampling_params, input_ids, dict(
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, rid=rid, return_routed_experts=return_routed_experts,
            stream=stream, **kw))
        try:
            b = await native.batch(self._serving, req)
            if stream:
                return _errors_as_value_errors(native.objects(b))
            return await native.result(b)
        except APIError as e:
            raise ValueError(e.message) from None

    # ---- RL control (the HTTP routes' bodies) -------------------------------------------------------
    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None
                                   ) -> dict[str, Any]:
        """Replace the named weights: [(name, tensor)] or {name: tensor} (load_format None/"direct"), or a
        flattened bucket {"flattened_tensor", "metadata"} ("flattened_bucket"); all or nothing, in the live
        layout. (No prefix survives an update, so `flush_cache` needs nothing more.)"""
        from splash.server import tensor_ipc, weights

        obj = list(named_tensors.items()) if isinstance(named_tensors, dict) and load_format != \
            "flattened_bucket" else named_tensors
        try:
            named = tensor_ipc.named_tensors(obj, load_format)
        except tensor_ipc.TensorPayloadError as e:
            return {"success": False, "message": str(e)}
        return self._body(weights.apply(self._engine, lambda e: e.update_weights_from_tensors(
            named, weight_version), f"{len(named)} tensors updated"))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None) -> dict[str, Any]:
        from splash.server import weights

        def fn(eng: Any) -> None:
            weights._load_format(load_format)
            eng.update_weights_from_disk(model_path, weight_version)
        return self._body(weights.apply(self._engine, fn, f"weights updated from {model_path}"))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str | None = None) -> dict[str, Any]:
        from splash.server import weights

        return self._body(weights.apply(self._engine, lambda e: e.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend),
            f"joined weight-update group {group_name!r}"))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None) -> dict[str, Any]:
        from splash.server import weights

        return self._body(weights.apply(self._engine, lambda e: e.update_weights_from_distributed(
            names, [str(d).removeprefix("torch.") for d in dtypes], shapes, group_name, weight_version),
            f"{len(names)} tensors updated from group {group_name!r}"))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        from splash.server import weights

        return self._body(weights.apply(self._engine, lambda e: e.destroy_weights_update_group(group_name),
                                        f"left weight-update group {group_name!r}"))

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        from splash.server import weights

        return self._body(weights.apply(self._engine, lambda e: e.release_memory_occupation(tags),
                                        f"released {', '.join(tags or ['kv_cache', 'weights'])}"))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        from splash.server import weights

        return self._body(weights.apply(self._engine, lambda e: e.resume_memory_occupation(tags),
                                        f"resumed {', '.join(tags or ['kv_cache', 'weights'])}"))

    def flush_cache(self) -> dict[str, Any]:
        from splash.server import native

        return self._body(native.flush(self._engine))

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        from splash.server import native

        return self._run(native.pause(self._engine, mode))

    def continue_generation(self) -> dict[str, Any]:
        from splash.server import native

        return self._run(native.resume(self._engine))

    def abort_request(self, rid: str | list[str] = "", abort_all: bool = False) -> dict[str, Any]:
        from splash.server import native
        from splash.server.native_protocol import AbortRequest

        return self._run(native.abort(self._engine, AbortRequest(rid=rid, abort_all=abort_all)))

    def get_server_info(self) -> dict[str, Any]:
        from splash.server.server_info import server_info

        return server_info(self._engine, self._engine.stats(), self.model_name, None)

    def get_weight_version(self) -> str:
        return self._engine.weight_version

    # ---- lifecycle --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine (and its ranks); idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._engine.shutdown()
        finally:
            self._stop_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- plumbing -----------------------------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        if getattr(self, "_closed", False):
            coro.close()
            raise RuntimeError("the engine was shut down")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except APIError as e:
            raise ValueError(e.message) from None

    def _body(self, coro: Any) -> dict[str, Any]:
        return self._run(coro)[1]

    def _iterate(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def _errors_as_value_errors(agen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for o in agen:
            yield o
    except APIError as e:
        raise ValueError(e.message) from None
    finally:
        await agen.aclose()
