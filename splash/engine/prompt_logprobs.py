"""Prompt logprobs (vLLM's `prompt_logprobs`, SGLang's `logprob_start_len`, OpenAI's `echo`): the logprob of
every prompt token given the ones before it, computed as the prompt is prefilled.

The row at position p already runs through the model in prefill; its logits give the logprob of prompt
token p + 1. Only steps holding a request that asked mark such rows (a `RowLogprobs` on the plan); the
runner turns them into logprobs chunk by chunk, never keeping [rows, V] logits, and every other step is
untouched. Chunked prefill, any layout and recompute after preemption need nothing more: each position is
kept once, by the first slice of the request that computes it (`Request.prompt_lp_next`). A prefix
cache must not skip the cached rows of such a request (their logits are needed).
"""

from __future__ import annotations

from collections.abc import Sequence

from splash.engine.request import Request
from splash.engine.request import Sequence as Seq
from splash.step.plan import RowLogprobs, SeqSlice


def start(req: Request) -> None:
    """Prepare `req` if it asked (at admission): positions before the start stay None, as position 0."""
    p = req.params
    if p.prompt_logprobs is None:
        return
    n = len(req.prompt_token_ids)
    if p.prompt_logprobs_start >= n:
        raise ValueError(f"prompt logprobs start at position {p.prompt_logprobs_start} but the prompt has "
                         f"{n} tokens; start below {n}")
    req.prompt_logprobs = [None] * n
    req.prompt_lp_next = max(p.prompt_logprobs_start, 1) - 1  # the row whose logits score that token


def rows_of(seqs: Sequence[Seq], slices: Sequence[SeqSlice]
            ) -> tuple[RowLogprobs, list[tuple[Request, int]]] | None:
    """The step's rows whose logits score a prompt token still missing, or None (no request asked)."""
    if not any(s.group.prompt_logprobs is not None for s in seqs):
        return None
    rows: list[int] = []
    targets: list[int] = []
    where: list[tuple[Request, int]] = []
    top, r0 = 0, 0
    for seq, sl in zip(seqs, slices):
        req = seq.group
        if req.prompt_logprobs is not None:
            ids = req.prompt_token_ids
            lo, hi = max(req.prompt_lp_next, sl.start), min(sl.start + sl.num_new, len(ids) - 1)
            for pos in range(lo, hi):
                rows.append(r0 + pos - sl.start)
                targets.append(ids[pos + 1])
                where.append((req, pos + 1))
            if hi > lo:
                req.prompt_lp_next = hi
                top = max(top, req.params.prompt_logprobs or 0)
        r0 += sl.num_new
    return (RowLogprobs(rows, targets, top), where) if rows else None


def keep(want: RowLogprobs, where: list[tuple[Request, int]]) -> None:
    """Store the runner's results: {token: logprob} per position, the prompt token first, then the top."""
    got, top_v, top_i = want.result
    got = got.tolist()
    tv, ti = (top_v.tolist(), top_i.tolist()) if top_v is not None else (None, None)
    for j, ((req, pos), tok) in enumerate(zip(where, want.targets)):
        d = {tok: got[j]}
        k = req.params.prompt_logprobs or 0
        if k and tv is not None:
            for t, v in zip(ti[j][:k], tv[j][:k]):
                d.setdefault(t, v)
        req.prompt_logprobs[pos] = d
