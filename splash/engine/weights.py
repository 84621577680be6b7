"""Rank 0's side of weight updates and memory release: check what rank 0 can alone (names, full shapes,
dtypes, a checkpoint's completeness), then send one `StepPlan(kind="weights", payload=WeightOp)`
between two steps; every rank runs it (splash/worker/weights.py) and the ranks agree before any
commits."""

from __future__ import annotations

import os
from typing import Any

import torch

from splash.model.update import WeightUpdateError, check_names, full_shapes, parse_dtype, required_names
from splash.step.plan import StepPlan
from splash.worker.weights import MEMORY_TAGS, WeightOp, rank_op

__all__ = ["MEMORY_TAGS", "WeightOp", "disk_op", "dist_op", "local_model", "run_op", "tensors_op"]


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
            from splash.distributed.comm import LocalCommunicator

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
    from splash.core.model_config import ConfigError, ModelConfig
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
