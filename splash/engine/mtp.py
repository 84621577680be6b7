"""Speculative decoding with the checkpoint's MTP layers (`--speculative-algorithm MTP`, or EAGLE as
SGLang spells it), rank 0's side: after every step, one "draft" plan that every rank runs
(ModelRunner.draft).

The draft phase follows SGLang's EAGLE worker (verify, then draft extend, then draft): for every request
of the step that is still running, the MTP layer runs over the rows the step made final (a prefill
chunk, or a verify slice's accepted rows) with each row's *next* token, which writes their draft KV
(the `mtp_latent` store, in the request's own pages, placed by the layout like the latent); from the
last row of each request that will decode next, a chain of k greedy drafts follows, one MTP row per
draft (their draft KV lands past the accepted tokens and is overwritten once those positions are
final). The drafts become the request's verify rows in the next step, exactly as n-gram drafts do
(splash/engine/spec.py): acceptance, books, prefix cache and switches are the same.

Placement: the draft phase runs after the step in the layout the step ended in, so a live switch (which
moves the MTP layer's weights and KV with the others) never meets a half-drafted request. Drafts only
ever change which rows are verified, never a token: a request the draft phase skips (or a draft KV row
left from a rejected chain) costs acceptance, not correctness. The chain's pages are grown here (it
writes past the accepted rows), never by preempting anyone: a request whose pages cannot grow drafts
fewer tokens.

A finished request is drafted too where a stage kept its pages for it (`keep`: a PD prefill, whose
last chunk's draft KV and first chain go to the decode side, splash/engine/stages/pd.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splash.engine.request import SeqStatus
from splash.step.plan import DraftWork, SeqSlice, StepPlan


class MtpDrafter:
    """Builds each step's draft plan and hands the drafts to the scheduler (its `proposer`)."""

    def __init__(self, scheduler: Any, runner: Any, can_speculate: Callable[[Any], int]) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.can_speculate = can_speculate  # seq -> drafts it may take next step (0: none)
        self.drafts: dict[Any, list[int]] = {}  # sequence -> the chain of the last draft phase, until taken
        # finished sequences drafted anyway this step: sequence -> (its kept page table, slot, chain length)
        self.keep: dict[Any, tuple[list[list[int]], int, int]] = {}
        scheduler.proposer = self.propose

    def propose(self, seq: Any, room: int) -> list[int]:
        """The drafts the last draft phase chained for `seq` (once), cut to `room`."""
        return self.drafts.pop(seq, [])[:room]

    def after_step(self, st: Any) -> None:
        """Run the draft phase for the step `st` just completed (its acceptance already counted). When no
        request chains drafts next and none is kept, there is no phase: the ranks write these rows'
        draft KV at the start of the next step (ModelRunner.extend_lagged), saving a call to every rank."""
        alloc = self.scheduler.alloc
        todo: list[tuple[Any, Any, int, int, Any, int]] = []  # (seq, slice, first row, end, kept, k)
        row = 0
        for seq, sl in zip(st.seqs, st.plan.seqs):
            first, row = row, row + sl.num_new
            self.drafts.pop(seq, None)
            end, kept = seq.num_computed, self.keep.get(seq)
            pages = seq.pages if kept is None else kept[0]
            if (seq.status is not SeqStatus.RUNNING and kept is None) or not pages or end <= sl.start \
                    or seq.num_tokens <= end:
                continue  # finished, preempted, or nothing final (the next token is not known yet)
            k = (self.can_speculate(seq) if kept is None else kept[2]) if seq.num_tokens == end + 1 else 0
            k = min(k, self.scheduler.cfg.max_model_len - seq.num_tokens)
            todo.append((seq, sl, first, end, kept, k))
        if not any(k > 0 or kept is not None for *_, kept, k in todo):
            return
        slices: list[SeqSlice] = []
        ids: list[int] = []
        src: list[int] = []
        chain: list[int] = []
        chained: list[Any] = []  # the sequences with a chain, in slice order
        for seq, sl, first, end, kept, k in todo:
            pages, slot = (seq.pages, seq.slot) if kept is None else kept[:2]
            while k > 1 and not alloc.can_grow(pages, end + k - 1, seq.owner):
                k -= 1  # (its chain writes the draft KV of positions end .. end + k - 2)
            if k > 1:
                alloc.grow(pages, end + k - 1, seq.owner)
            slices.append(SeqSlice(seq.seq_id, sl.start, end - sl.start, seq.owner, pages, False, slot))
            ids.extend(seq.token_slice(sl.start + 1, end + 1))
            src.append(first)
            chain.append(max(k, 0))
            if k > 0:
                chained.append(seq)
        plan = StepPlan(step=st.plan.step, layout=self.scheduler.layout, input_ids=ids, seqs=slices,
                        kind="draft", payload=DraftWork(src, chain))
        out = self.runner.draft(plan)
        if out is None:
            return
        for seq, n, row_ids in zip(chained, (n for n in chain if n > 0), out.tolist()):
            self.drafts[seq] = row_ids[:n]
