"""Rank 0's runner on T ranks: each step plan goes to every rank, then rank 0 runs its own share."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from splash.distributed.launch import WorkerError
from splash.engine.group import GroupFailed
from splash.step import wire
from splash.step.plan import StepPlan
from splash.worker.runner import ModelRunner, decoded


class GroupRunner:
    """Rank 0's runner on T ranks: each plan goes to every rank, then rank 0 runs its own share.

    The step is SPMD: the workers run the same forward on their shard (splash/worker/loop.py); only
    rank 0 computes logits, since the LM head is replicated. Any failure marks the group failed (see
    RankGroup.guarded) and every later step raises at once.
    """

    def __init__(self, group: Any, local: ModelRunner, owns_group: bool = True) -> None:
        self.group = group
        self.local = local
        self.owns_group = owns_group
        self.device = local.device
        self.encoder = wire.PlanEncoder(group.world)

    @property
    def step_rows(self) -> OrderedDict[int, int]:
        return self.local.step_rows

    def failure(self) -> BaseException | None:
        """Why the rank group can run no more steps (None while it can): it failed, was closed, or a
        local worker has exited, even while idle (that marks the group failed)."""
        try:
            self.group.check()
        except (GroupFailed, WorkerError) as e:
            return self.group.error or e
        return None

    def execute(self, plan: StepPlan) -> torch.Tensor:
        cs = self.local.comm.stats
        cs.begin_step(plan.step)  # the plan's own broadcast counts towards its step
        return self.group.guarded(self._step, plan)

    def _step(self, plan: StepPlan) -> torch.Tensor:
        msg = self.encoder.encode(plan)
        self.group.send(msg)
        return self.local.execute(decoded(plan, msg))

    def draft(self, plan: StepPlan) -> torch.Tensor | None:
        """The draft phase of speculative decoding with MTP layers (ModelRunner.draft) on every rank."""
        return self.group.guarded(self._draft, plan)

    def _draft(self, plan: StepPlan) -> torch.Tensor | None:
        msg = self.encoder.encode(plan)
        self.group.send(msg)
        return self.local.draft(decoded(plan, msg))

    def restore_state(self, slots: list[int]) -> None:
        """Every rank puts back the state snapshot of `slots` (a KDA hybrid's rejected drafts)."""
        self.group.guarded(self._restore_state, slots)

    def _restore_state(self, slots: list[int]) -> None:
        from splash.step.plan import control_plan

        self.group.send(control_plan("state", payload=list(slots)))
        self.local.restore_state(slots)

    def copy_state(self, pairs: list[tuple[int, int]]) -> None:
        """Every rank copies state rows src -> dst in order (a KDA hybrid's prefix snapshots)."""
        self.group.guarded(self._copy_state, pairs)

    def _copy_state(self, pairs: list[tuple[int, int]]) -> None:
        from splash.step.plan import control_plan

        self.group.send(control_plan("state", payload={"copy": list(pairs)}))
        self.local.copy_state(pairs)

    def decode_plan_bytes_p50(self) -> int | None:
        """Median bytes of the step message over forward steps with no prefill rows."""
        return self.encoder.decode_bytes_p50()

    def rank_tables(self) -> list[dict[int, list[int]]]:
        """Every rank's own page tables {req_id: local pages} (tests and debugging; one control message)."""
        return self.group.gather_tables()

    def comm_stats(self) -> list[dict[str, Any]]:
        """Every rank's collective byte counters (one control message; call it when needed)."""
        return self.group.gather_stats()

    def shutdown(self) -> None:
        """Stop the workers (or, on a shared group, just drop this engine's shards)."""
        if self.owns_group:
            self.group.close()
        elif self.group.owner is None or self.group.owner is self:
            self.group.unload()
