"""Counters and timings every request contributes to: prompt tokens computed for the first time (a
recompute after preemption is not asked-for work), generated tokens, and each request's first-scheduled,
first- and last-token times (its `RequestMetrics`). Per sequence it keeps how far its prompt was computed."""

from __future__ import annotations

import time
from typing import Any

from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled
from splash.engine.stages.base import Stage


class Metrics(Stage):
    NAMES = {n: n for n in ("prompt_tokens_total", "generation_tokens_total")}  # what the engine answers

    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prompt_high: dict[Seq, int] = {}  # prompt tokens computed at least once, per sequence

    def before_execute(self, st: Any) -> None:
        now = time.time()
        for seq in st.seqs:
            m = seq.group.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now

    def after_execute(self, st: Any, logits: Any) -> None:
        high = self.prompt_high
        for seq, sl in zip(st.seqs, st.plan.seqs):
            hi = min(sl.start + sl.num_new, len(seq.prompt_token_ids))
            was = high.get(seq, 0)
            if hi > was:
                self.prompt_tokens_total += hi - was
                high[seq] = hi

    def on_token(self, seq: Seq, s: Sampled, now: float) -> None:
        self.generation_tokens_total += 1
        m = seq.group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now

    def on_drop(self, seq: Seq) -> None:
        self.prompt_high.pop(seq, None)

    def stats(self) -> dict[str, Any]:
        return {"prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total}
