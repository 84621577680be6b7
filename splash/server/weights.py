"""SGLang's weight-update and memory routes: update from disk, from a colocated trainer's tensors
(shared memory / CUDA IPC) or a trainer's broadcast; release/resume (with --enable-memory-saver).

Each answers `{"success": bool, "message": str}`, as SGLang does: 200 when applied, 400 when refused
(the message names the tensor or argument at fault; nothing was changed and the old weights keep
serving). The work runs on the engine thread between two steps (`AsyncEngine.call`), on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from splash.model.update import WeightUpdateError
from splash.server.native_protocol import (
    DestroyGroupRequest,
    InitGroupRequest,
    MemoryRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
)
from splash.server.tensor_ipc import TensorPayloadError, read_payloads

log = logging.getLogger("splash.server")


async def apply(engine: Any, fn: Callable[[Any], Any], done: str, abort_first: bool = False
                ) -> tuple[int, dict[str, Any]]:
    """Run `fn(llm_engine)` between two steps: (200, {success, message, weight_version}), or (400, the
    same with success false and the reason) when refused. splash.Engine returns the same bodies."""
    def run(eng: Any) -> Any:
        if abort_first:
            engine._finish_outputs(eng.abort_all())  # (the engine thread: streams end with abort)
        return fn(eng)

    try:
        await engine.call(run)
    except (WeightUpdateError, ValueError) as e:
        return 400, {"success": False, "message": str(e)}
    log.info("%s (weight version %s)", done, engine.weight_version)
    return 200, {"success": True, "message": done, "weight_version": engine.weight_version}


async def _apply(engine: Any, fn: Callable[[Any], Any], done: str, abort_first: bool = False
                 ) -> JSONResponse:
    status, body = await apply(engine, fn, done, abort_first)
    return JSONResponse(body, status_code=status)


async def update_from_tensor(engine: Any, req: UpdateFromTensorRequest) -> tuple[int, dict[str, Any]]:
    """SGLang's /update_weights_from_tensor: every rank's payload read (shared memory or CUDA IPC, never
    the sender's code), merged by name, then one all-or-nothing update in the live layout."""
    try:
        named = await run_in_threadpool(read_payloads, req.serialized_named_tensors, req.load_format)
    except TensorPayloadError as e:
        return 400, {"success": False, "message": str(e)}
    # (the sender's shared segments are released with the last reference, when this returns)
    return await apply(engine, lambda eng: eng.update_weights_from_tensors(named, req.weight_version),
                       f"{len(named)} tensors updated", req.abort_all_requests)


def _load_format(fmt: str | None) -> None:
    if fmt not in (None, "auto", "safetensors"):
        raise WeightUpdateError(f"load_format {fmt!r} is not supported; leave it out (safetensors)")


def install(app: FastAPI, engine: Any) -> None:
    r = APIRouter()

    @r.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateFromDiskRequest) -> JSONResponse:
        def fn(eng: Any) -> None:
            _load_format(req.load_format)
            eng.update_weights_from_disk(req.model_path, req.weight_version)

        return await _apply(engine, fn, f"weights updated from {req.model_path}", req.abort_all_requests)

    @r.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateFromTensorRequest) -> JSONResponse:
        status, body = await update_from_tensor(engine, req)
        return JSONResponse(body, status_code=status)

    @r.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitGroupRequest) -> JSONResponse:
        return await _apply(engine, lambda eng: eng.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name,
            req.backend), f"joined weight-update group {req.group_name!r}")

    @r.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateFromDistributedRequest) -> JSONResponse:
        def fn(eng: Any) -> None:
            _load_format(req.load_format)
            eng.update_weights_from_distributed(req.names, req.dtypes, req.shapes, req.group_name,
                                                req.weight_version)

        return await _apply(engine, fn, f"{len(req.names)} tensors updated from group {req.group_name!r}",
                            req.abort_all_requests)

    @r.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyGroupRequest) -> JSONResponse:
        return await _apply(engine, lambda eng: eng.destroy_weights_update_group(req.group_name),
                            f"left weight-update group {req.group_name!r}")

    @r.post("/release_memory_occupation")
    async def release_memory_occupation(req: MemoryRequest) -> JSONResponse:
        return await _apply(engine, lambda eng: eng.release_memory_occupation(req.tags),
                            f"released {', '.join(req.tags or ['kv_cache', 'weights'])}")

    @r.post("/resume_memory_occupation")
    async def resume_memory_occupation(req: MemoryRequest) -> JSONResponse:
        return await _apply(engine, lambda eng: eng.resume_memory_occupation(req.tags),
                            f"resumed {', '.join(req.tags or ['kv_cache', 'weights'])}")

    app.include_router(r)
