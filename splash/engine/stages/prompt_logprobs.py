"""Prompt logprobs (vLLM's `prompt_logprobs`, SGLang's `logprob_start_len`, OpenAI's `echo`): the logprob of
every prompt token given the ones before it, computed as the prompt is prefilled.

The row at position p already runs through the model in prefill; its logits give the logprob of prompt
token p + 1. Only steps holding a request that asked mark such rows (a `RowLogprobs` on the plan); the
runner turns them into logprobs chunk by chunk, never keeping [rows, V] logits, and every other step is
untouched. Chunked prefill, any layout and recompute after preemption need nothing more: each position is
kept once, by the first slice of the request that computes it (`PromptLogprobs.next`). A prefix cache
must not skip the cached rows of such a request (their logits are needed). State per request, in this
stage's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splash.engine.request import Request
from splash.engine.request import Sequence as Seq
from splash.engine.stages.base import Stage
from splash.step.plan import RowLogprobs


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs: per position {token: logprob} (None where not computed: position 0,
    before the start), and the next position a prefill row may fill."""

    values: list[dict[int, float] | None]
    next: int
    top: int  # the most likely tokens kept beside the prompt's own


class PromptLogprobsStage(Stage):
    def __init__(self) -> None:
        self.table: dict[Request, PromptLogprobs] = {}
        self._want: tuple[RowLogprobs, list[tuple[PromptLogprobs, int]]] | None = None

    def on_add(self, seq: Seq) -> None:
        """Prepare the request if it asked (its first sequence): positions before the start stay None."""
        req, p = seq.group, seq.params
        if p.prompt_logprobs is None or seq.index:
            return
        n = len(req.prompt_token_ids)
        if p.prompt_logprobs_start >= n:
            raise ValueError(f"prompt logprobs start at position {p.prompt_logprobs_start} but the prompt "
                             f"has {n} tokens; start below {n}")
        # (the row whose logits score the first token asked for)
        self.table[req] = PromptLogprobs([None] * n, max(p.prompt_logprobs_start, 1) - 1, p.prompt_logprobs)

    def before_execute(self, st: Any) -> None:
        """Mark the step's rows whose logits score a prompt token still missing (none: the plan as is)."""
        self._want = None
        if not self.table:
            return
        rows: list[int] = []
        targets: list[int] = []
        where: list[tuple[PromptLogprobs, int]] = []
        top, r0 = 0, 0
        for seq, sl in zip(st.seqs, st.plan.seqs):
            got = self.table.get(seq.group)
            if got is not None:
                ids = seq.prompt_token_ids
                lo, hi = max(got.next, sl.start), min(sl.start + sl.num_new, len(ids) - 1)
                for pos in range(lo, hi):
                    rows.append(r0 + pos - sl.start)
                    targets.append(ids[pos + 1])
                    where.append((got, pos + 1))
                if hi > lo:
                    got.next = hi
                    top = max(top, got.top)
            r0 += sl.num_new
        if rows:
            self._want = (RowLogprobs(rows, targets, top), where)
            st.plan.row_logprobs = self._want[0]

    def after_execute(self, st: Any, logits: Any) -> None:
        """Store the runner's results: {token: logprob} per position, the prompt token first, then the top."""
        if self._want is None:
            return
        want, where = self._want
        self._want = None
        got, top_v, top_i = want.result
        got = got.tolist()
        tv, ti = (top_v.tolist(), top_i.tolist()) if top_v is not None else (None, None)
        for j, ((rec, pos), tok) in enumerate(zip(where, want.targets)):
            d = {tok: got[j]}
            if rec.top and tv is not None:
                for t, v in zip(ti[j][:rec.top], tv[j][:rec.top]):
                    d.setdefault(t, v)
            rec.values[pos] = d

    def request_output(self, req: Request, fields: dict[str, Any]) -> None:
        got = self.table.get(req)
        if got is not None:
            fields["prompt_logprobs"] = list(got.values)

    def on_drop(self, seq: Seq) -> None:
        self.table.pop(seq.group, None)
