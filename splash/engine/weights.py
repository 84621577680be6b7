"""Weight updates and memory release on every rank: the "weights" control plan and its handler.

Rank 0 checks what it can alone (names, full shapes, dtypes, a checkpoint's completeness), then sends
one `StepPlan(kind="weights", payload=WeightOp)` between two steps; every rank - rank 0 included -
runs `rank_op`: it receives or reads the new tensors, stages its own block of each (the loader's
spans over the live modules, splash/model/update.py), and the ranks agree by one gather before any
of them commits. So an update is all or nothing across ranks too, and lands in whatever layout runs.

Memory release frees the KV pool tensor and/or the weight buffers on every rank (weights saved to a
per-rank file first, unless discarded), and resume gives them back.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from splash.model.update import (
    TensorReader,
    WeightUpdateError,
    check_names,
    commit,
    full_shapes,
    parse_dtype,
    release_weights,
    required_names,
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
    from splash.core.config import ModelConfig
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
    from splash.dist.weight_group import join_group

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
            from splash.core.config import ModelConfig
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


# ---- rank 0 -------------------------------------------------------------------------------------------
def local_model(engine: Any) -> Any:
    runner = engine.runner
    return getattr(runner, "local", runner).model


def run_op(engine: Any, op: WeightOp) -> dict[str, Any]:
    """Send `op` to every rank and run rank 0's share; the agreed reply. Call between steps only."""
    runner = engine.runner
    group = getattr(runner, "group", None)
    if group is None:  # one rank
        comm = runner.comm
        if comm is None:
            from splash.dist.comm import LocalCommunicator

            comm = LocalCommunicator(runner.device)
        return rank_op(runner, comm, 0, op)

    def go() -> dict[str, Any]:
        group.send(StepPlan(step=-1, layout=engine.allocator.layout, input_ids=[], kind="weights",
                            payload=op))
        mine = rank_op(runner.local, group.grid.comm, 0, op)
        replies = group.gather(mine)
        bad = next((r for r in replies if not r.get("ok")), None)
        return bad or mine

    return group.guarded(go)


def disk_op(engine: Any, path: str) -> WeightOp:
    """Check a checkpoint directory against the live model (complete, right shapes) on rank 0."""
    from splash.core.config import ConfigError, ModelConfig
    from splash.model.loader import CheckpointReader

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise WeightUpdateError(f"model_path {path!r} is not a checkpoint directory with config.json")
    try:
        reader = CheckpointReader(path, ModelConfig.from_hf(path).quantization_config)
    except (ConfigError, OSError, ValueError) as e:
        raise WeightUpdateError(f"cannot read checkpoint {path!r}: {e}") from None
    model = local_model(engine)
    try:
        known = full_shapes(model)
        names = [n for n in reader.keys() if n in known]
        stacked = any(n.endswith("experts.gate_up_proj") for n in names)
        missing = sorted(required_names(model, stacked) - set(names))
        if missing:
            raise WeightUpdateError(f"checkpoint {path!r} lacks tensor {missing[0]!r} ({len(missing)} "
                                    f"missing); an update from disk must provide every weight")
        check_names(model, {n: reader.shape(n) for n in names})
    finally:
        reader.close()
    return WeightOp("disk", {"path": os.path.abspath(path), "names": names})


def tensors_op(engine: Any, named: Any) -> WeightOp:
    """Check named full tensors ({name: tensor} or [(name, tensor)]) on rank 0."""
    items = list(named.items()) if hasattr(named, "items") else list(named)
    if not items:
        raise WeightUpdateError("no tensors given")
    tensors = {}
    for n, t in items:
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"tensor {n!r} is a {type(t).__name__}, not a torch.Tensor")
        if n in tensors:
            raise WeightUpdateError(f"tensor {n!r} is given twice")
        parse_dtype(t.dtype)
        tensors[n] = t.detach().to("cpu")
    check_names(local_model(engine), {n: t.shape for n, t in tensors.items()})
    return WeightOp("tensors", {"tensors": tensors})


def dist_op(engine: Any, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
            ) -> WeightOp:
    """Check a broadcast's metadata; a wrong name or shape is still received (the trainer is already
    sending) and refused afterwards; unreadable metadata is refused at once."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise WeightUpdateError(f"names, dtypes and shapes must be non-empty lists of one length "
                                f"(got {len(names)}, {len(dtypes)}, {len(shapes)})")
    for n, dt, s in zip(names, dtypes, shapes):
        parse_dtype(dt)
        if not isinstance(s, (list, tuple)) or any(not isinstance(x, int) or x < 0 for x in s):
            raise WeightUpdateError(f"tensor {n!r}: shape {s!r} is not a list of non-negative integers")
    refuse = None
    if len(set(names)) != len(names):
        refuse = "a tensor name is given twice"
    else:
        try:
            check_names(local_model(engine), dict(zip(names, shapes)))
        except WeightUpdateError as e:
            refuse = str(e)
    return WeightOp("dist", {"names": list(names), "dtypes": list(dtypes),
                             "shapes": [list(s) for s in shapes], "group_name": group_name, "refuse": refuse})
