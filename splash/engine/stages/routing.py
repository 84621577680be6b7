"""Routed experts per position (`return_routed_experts`, routing replay for RL) as a stage: the recorder
on rank 0's routers (splash/engine/routing.py) is armed only in steps holding a request that asked, and
each asking sequence's expert ids are kept in this stage's table, chunk by chunk (a recompute after
preemption replaces the positions it recomputes); a finished sequence reports them all."""

from __future__ import annotations

from typing import Any

from splash.engine.request import Sequence as Seq
from splash.engine.stages.base import Stage


class Routing(Stage):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.recorder: Any = None  # RoutingRecorder, made when a request first asks
        self.armed = False
        self.chunks: dict[Seq, list[tuple[int, Any]]] = {}  # (start position, expert ids [n, layers, k])

    def before_execute(self, st: Any) -> None:
        self.armed = any(s.params.return_routed_experts for s in st.seqs)
        if not self.armed:
            return
        if self.recorder is None:
            from splash.engine.routing import RoutingRecorder
            from splash.engine.weights import local_model

            self.recorder = RoutingRecorder(local_model(self.engine))
        self.recorder.arm()

    def after_execute(self, st: Any, logits: Any) -> None:
        if not self.armed:
            return
        self.armed = False
        ids = self.recorder.take()
        if ids is None:
            return
        row = 0
        for seq, sl in zip(st.seqs, st.plan.seqs):
            if seq.params.return_routed_experts:
                self.keep(seq, sl.start, ids[row:row + sl.num_new])
            row += sl.num_new

    def keep(self, seq: Seq, start: int, ids: Any) -> None:
        """Routed experts of positions start.. (a recompute after preemption replaces later ones)."""
        got = self.chunks.get(seq)
        if got and got[-1][0] + len(got[-1][1]) == start:
            got.append((start, ids))  # the usual case: the next positions, in order
            return
        kept = [(s, c[:max(0, start - s)]) for s, c in (got or []) if s < start]
        self.chunks[seq] = [x for x in kept if len(x[1])] + [(start, ids)]

    def output(self, seq: Seq, fields: dict[str, Any]) -> None:
        got = self.chunks.get(seq)
        if got and seq.status.done:
            import torch

            fields["routed_experts"] = torch.cat([c for _, c in got])

    def on_drop(self, seq: Seq) -> None:
        self.chunks.pop(seq, None)
