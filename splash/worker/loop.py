"""The plan loop every rank follows: worker ranks run it as their whole life, rank 0 mirrors it.

A worker waits on the control plane for the next `StepPlan` from rank 0 and dispatches on its kind:
"load" builds this rank's model shard and KV pool from the `RuntimeSpec` payload (answering with its
`RankFacts` through a gather, or with the error that stopped it), "forward" runs the SPMD step, "stats"
sends its CommStats to rank 0, "unload" drops the shard, "shutdown" ends the loop; "switch" is a
forward step in which the layout switches (the runner runs it, splash/switch/step.py). Steps arrive
as compact messages (splash/step/wire.py) that update the rank's own page tables. New kinds plug in
with `register_handler`, on every rank, before the group starts.

A handler that raises ends the worker with its traceback (start_workers reports it to rank 0's
process); rank 0's own collectives then fail or time out, so the engine fails instead of hanging.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splash.step import wire
from splash.step.plan import StepPlan
from splash.worker.host_malloc import freeze_heap, thaw_heap
from splash.worker.load import RankFacts

log = logging.getLogger("splash.worker")


@dataclass
class WorkerState:
    """What one rank holds between plans."""

    grid: Any
    rank_state: Any = None  # splash.worker.load.RankState once loaded
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # room for plug-ins (e.g. a switch executor)

    @property
    def runner(self) -> Any:
        if self.rank_state is None:
            raise RuntimeError(f"rank {self.grid.rank}: a step arrived before any model was loaded")
        return self.rank_state.runner


Handler = Callable[[WorkerState, StepPlan], None]
HANDLERS: dict[str, Handler] = {}


def register_handler(kind: str, fn: Handler) -> None:
    """Teach workers a plan kind (registered at import time of the module that defines it)."""
    HANDLERS[kind] = fn


# ---- the pieces rank 0 shares with workers ----------------------------------------------------------
def load_reply(state: WorkerState, plan: StepPlan) -> RankFacts | dict[str, str]:
    """Build this rank's share from the spec; what it measured (or its error) rank 0 gathers from every
    rank."""
    from splash.worker.load import load_rank

    unload(state)
    try:
        state.rank_state = load_rank(plan.payload, state.grid)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it with this rank's number
        return {"error": f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)}
    state.grid.comm.stats.reset()
    return state.rank_state.facts


def unload(state: WorkerState) -> None:
    """Drop the model shard and KV pool (before loading another, or on request)."""
    if state.rank_state is None:
        return
    state.rank_state = None
    thaw_heap()  # (a worker froze its shard after loading it)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stats_reply(state: WorkerState) -> dict[str, Any]:
    """This rank's collective byte counters: per step (kept history + current) and in total."""
    return state.grid.comm.stats.reply(state.grid.rank)


# ---- handlers -----------------------------------------------------------------------------------------
def _on_load(state: WorkerState, plan: StepPlan) -> None:
    reply = load_reply(state, plan)
    if state.rank_state is not None:
        # A worker process is ours: its shard lives until the next unload (`splash serve` does the same
        # on rank 0).
        freeze_heap()
    state.grid.comm.all_gather_object(reply)


def _on_forward(state: WorkerState, plan: StepPlan) -> None:
    state.runner.forward(plan)
    state.steps += 1


def _on_stats(state: WorkerState, plan: StepPlan) -> None:
    state.grid.comm.all_gather_object(stats_reply(state))


def _on_unload(state: WorkerState, plan: StepPlan) -> None:
    unload(state)


def tables_reply(state: WorkerState) -> dict[int, list[int]]:
    """This rank's own page tables, {req_id: local pages} (empty before any model is loaded)."""
    return state.runner.tables.snapshot() if state.rank_state is not None else {}


def _on_tables(state: WorkerState, plan: StepPlan) -> None:
    state.grid.comm.all_gather_object(tables_reply(state))


register_handler("load", _on_load)
register_handler("forward", _on_forward)
register_handler("switch", _on_forward)  # a step in which the layout switches: the runner runs it
register_handler("stats", _on_stats)
register_handler("unload", _on_unload)
register_handler("tables", _on_tables)


def _on_weights(state: WorkerState, plan: StepPlan) -> None:
    from splash.worker.weights import on_weights_plan  # weight updates, memory release (RL)

    on_weights_plan(state, plan)


register_handler("weights", _on_weights)


def _on_pd(state: WorkerState, plan: StepPlan) -> None:
    from splash.worker.pd import on_pd_plan  # prefill/decode disaggregation: this rank's KV writes

    on_pd_plan(state, plan)


register_handler("pd", _on_pd)


def _on_draft(state: WorkerState, plan: StepPlan) -> None:
    state.runner.draft(plan)  # speculative decoding with MTP layers: the draft phase after a step


register_handler("draft", _on_draft)


def _on_state(state: WorkerState, plan: StepPlan) -> None:
    if isinstance(plan.payload, dict):  # a KDA hybrid's prefix snapshots saved / loaded (kv/snapshots.py)
        state.runner.copy_state(plan.payload["copy"])
    else:
        state.runner.restore_state(plan.payload)  # a KDA hybrid's rejected drafts: the state snapshot back


register_handler("state", _on_state)


def set_data_timeout(grid: Any, timeout_s: float | None, control: bool = False) -> None:
    """Lower the data-plane groups' timeout after start-up (and the control group's, on rank 0).

    Groups are formed with a generous start-up timeout - spawning T processes that each import torch
    can take long on a busy machine - then steps get `timeout_s`, so a hung peer fails them quickly.
    """
    if timeout_s is None or grid.world == 1:
        return
    if hasattr(grid.comm, "timeout_s"):  # the shared-memory data plane keeps its own deadline
        grid.comm.timeout_s = float(timeout_s)
    import datetime

    from torch.distributed import distributed_c10d as c10d

    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # older torch: keep the start-up timeout
        log.warning("this torch cannot change a group's timeout; collectives keep the start-up timeout")
        return
    td = datetime.timedelta(seconds=float(timeout_s))
    groups = [grid.group, getattr(getattr(grid, "switch", None), "group", None)]
    if control:
        groups.append(grid.control)
    for g in dict.fromkeys(x for x in groups if x is not None):
        set_timeout(td, g)


def worker_main(grid: Any, timeout_s: float | None = None) -> int:
    """Entry point of a worker rank (the `target` of start_workers): follow plans until shutdown.
    `timeout_s` bounds each data-plane collective once the group is formed. Returns the number of
    forward steps run."""
    set_data_timeout(grid, timeout_s)
    state = WorkerState(grid)
    while True:
        msg = grid.comm.broadcast_object(None, src=0)
        plan = wire.decode(msg) if wire.is_step_message(msg) else msg
        if plan.kind == "shutdown":
            unload(state)
            return state.steps
        handler = HANDLERS.get(plan.kind)
        if handler is None:
            raise RuntimeError(f"rank {grid.rank}: no handler for plan kind {plan.kind!r} (a newer rank 0?)")
        handler(state, plan)
