"""Weight updates and memory release as every rank runs them: the "weights" control plan's handler.

Every rank - rank 0 included - runs `rank_op` with the same `WeightOp`: it reads or receives the new
tensors, stages its own block of each (the loader's spans over the live modules,
splash/model/update.py), and the ranks agree by one gather before any of them commits, so an update is
all or nothing across ranks and lands in whatever layout runs. Memory release frees the KV pool tensor
and/or the weight buffers (weights saved to a per-rank file first, unless discarded); resume gives them
back. Rank 0's side (checks, sending the op) is splash/engine/weights.py.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from splash.model.update import (
    TensorReader,
    WeightUpdateError,
    commit,
    parse_dtype,
    release_weights,
    restore_weights,
    stage,
)
from splash.step.plan import StepPlan

log = logging.getLogger("splash.weights")

MEMORY_TAGS = ("kv_cache", "weights")


@dataclass
class WeightOp:
    """One control operation every rank runs (picklable: it travels in a plan)."""

    kind: str  # "disk" | "tensors" | "dist" | "init_group" | "destroy_group" | "release" | "resume"
    args: dict[str, Any] = field(default_factory=dict)


# ---- every rank ---------------------------------------------------------------------------------------
def rank_op(runner: Any, comm: Any, rank: int, op: WeightOp) -> dict[str, Any]:
    """Run `op` on this rank; every rank calls it with the same op. Never raises for a refused op:
    the reply ({"ok", "error"}) says why, identically on every rank."""
    fn = _OPS[op.kind]
    try:
        local = fn(runner, comm, rank, op.args)
        err = None
    except Exception as e:  # noqa: BLE001 - agreed on below, reported to the caller
        log.debug("weights op %s failed on rank %d", op.kind, rank, exc_info=True)
        local, err = None, (str(e) if isinstance(e, WeightUpdateError) else f"{type(e).__name__}: {e}")
    if op.kind in ("disk", "tensors", "dist"):
        errors = comm.all_gather_object(err)
        bad = next(((r, x) for r, x in enumerate(errors) if x), None)
        if bad is not None:
            return {"ok": False, "error": bad[1] if comm.world == 1 else f"rank {bad[0]}: {bad[1]}"}
        commit(local)
        del local
        gc.collect()
        return {"ok": True}
    if op.kind == "init_group":
        errors = comm.all_gather_object(err)
        bad = next(((r, x) for r, x in enumerate(errors) if x), None)
        if bad is not None:
            g = _groups(runner).pop(op.args["group_name"], None)
            if g is not None:
                g.close()
            return {"ok": False, "error": bad[1] if comm.world == 1 else f"rank {bad[0]}: {bad[1]}"}
        return {"ok": True}
    return {"ok": err is None, "error": err}


def on_weights_plan(state: Any, plan: StepPlan) -> None:
    """Worker handler of kind "weights"."""
    reply = rank_op(state.runner, state.grid.comm, state.grid.rank, plan.payload)
    state.grid.comm.all_gather_object(reply)


def _groups(runner: Any) -> dict[str, Any]:
    if not hasattr(runner, "weight_groups"):
        runner.weight_groups = {}
    return runner.weight_groups


def _stage_disk(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> Any:
    from splash.core.model_config import ModelConfig
    from splash.model.loader import CheckpointReader

    reader = CheckpointReader(a["path"], ModelConfig.from_hf(a["path"]).quantization_config)
    try:
        return stage(runner.model, reader, a["names"])
    finally:
        reader.close()


def _stage_tensors(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> Any:
    return stage(runner.model, TensorReader(a["tensors"]), list(a["tensors"]))


def _stage_dist(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> Any:
    g = _groups(runner).get(a["group_name"])
    if g is None:
        raise WeightUpdateError(f"no weight-update group {a['group_name']!r} on this engine; call "
                                f"init_weights_update_group first")
    dev = runner.device if g.backend == "nccl" else torch.device("cpu")
    staged: list[Any] = []
    refuse = a.get("refuse")
    for name, dt, shape in zip(a["names"], a["dtypes"], a["shapes"]):
        t = torch.empty(tuple(shape), dtype=parse_dtype(dt), device=dev)
        g.broadcast(t, 0)  # every tensor is received, even once the request is refused
        if refuse is None:  # this rank's block now; the full tensor is dropped at once
            try:
                staged += stage(runner.model, TensorReader({name: t}), [name])
            except WeightUpdateError as e:
                refuse, staged = str(e), []
        del t
    if refuse is not None:
        raise WeightUpdateError(refuse)
    return staged


def _init_group(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> None:
    from splash.distributed.weight_group import join_group

    groups = _groups(runner)
    if a["group_name"] in groups:
        raise WeightUpdateError(f"weight-update group {a['group_name']!r} exists already; destroy it first "
                                f"or use another group_name")
    groups[a["group_name"]] = join_group(a["master_address"], a["master_port"], a["rank_offset"] + rank,
                                         a["world_size"], a["group_name"], a["backend"],
                                         a.get("timeout_s", 600.0), runner.device)


def _destroy_group(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> None:
    g = _groups(runner).pop(a["group_name"], None)
    if g is None:
        raise WeightUpdateError(f"no weight-update group {a['group_name']!r}")
    g.close()


def _release(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> None:
    held = runner.__dict__.setdefault("released", {})
    if getattr(runner, "graphs", None) is not None:
        runner.graphs.reset()  # captured decode graphs point at the memory freed here
    if "kv_cache" in a["tags"] and "kv_cache" not in held:
        pool = runner.pool
        held["kv_cache"] = pool.release()
        if getattr(runner, "state", None) is not None:  # a KDA hybrid's state slots go with the KV
            held["state"] = runner.state.release()
    if "weights" in a["tags"] and "weights" not in held:
        keep = a.get("backup", True)
        on_host = keep and runner.device.type != "cpu"  # an accelerator's weights wait in host memory
        backup = tempfile.mkdtemp(prefix="splash-weights-", dir=a.get("backup_dir")) if keep and not on_host \
            else None
        held["weights"] = release_weights(runner.model, backup, host_copy=on_host)
        held["weights"]["dir"] = backup
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        from splash.worker.host_malloc import give_back

        give_back()  # freed blocks kept for reuse (host_malloc) go back to the kernel too


def _resume(runner: Any, comm: Any, rank: int, a: dict[str, Any]) -> None:
    held = runner.__dict__.setdefault("released", {})
    if "weights" in a["tags"] and "weights" in held:
        saved = held.pop("weights")
        reload = None
        if a.get("checkpoint"):
            from splash.core.model_config import ModelConfig
            from splash.model.loader import CheckpointReader

            ckpt = a["checkpoint"]

            def reload() -> Any:
                return CheckpointReader(ckpt, ModelConfig.from_hf(ckpt).quantization_config)
        restore_weights(runner.model, saved, reload)
        if saved.get("dir"):
            shutil.rmtree(saved["dir"], ignore_errors=True)
    if "kv_cache" in a["tags"] and "kv_cache" in held:
        runner.pool.restore(held.pop("kv_cache"))
        if "state" in held:
            runner.state.restore(held.pop("state"))


_OPS = {"disk": _stage_disk, "tensors": _stage_tensors, "dist": _stage_dist, "init_group": _init_group,
        "destroy_group": _destroy_group, "release": _release, "resume": _resume}


