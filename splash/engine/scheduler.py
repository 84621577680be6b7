"""Continuous batching with chunked prefill, a per-step token budget and preemption by recompute.

Each step: running sequences first (decodes, then unfinished prefill chunks), each growing its page
table for the rows it gets; a sequence that cannot grow preempts the most recently admitted one not
yet scheduled this step (its pages are freed and it goes back to the front of the queue, to be
recomputed from prompt + generated tokens). Then queued sequences are admitted while the budget, the
`max_num_seqs` bound and the real per-rank free pages allow (a queued sequence is admitted only if
the pool could hold every token it already has, so its own prefill never preempts anyone).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splash.engine.plan import SeqSlice, StepPlan
from splash.engine.request import SeqStatus, Sequence
from splash.kv.allocator import KVAllocator


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")


@dataclass
class ScheduledStep:
    """A plan plus the sequences behind its slices (same order), kept on rank 0 only."""

    plan: StepPlan
    seqs: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.plan.seqs


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, alloc: KVAllocator) -> None:
        self.cfg = cfg
        self.alloc = alloc
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_no = 0
        self.num_preemptions = 0
        # Sequences the scheduler itself ended (context full with nobody left to preempt); the engine
        # drains this to report them.
        self.finished_by_scheduler: list[Sequence] = []

    # ---- bookkeeping ----------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return self.alloc.layout

    def max_seq_tokens(self) -> int:
        """Longest context a single sequence can have: the model's context and the whole pool."""
        return min(self.cfg.max_model_len, self.alloc.max_request_tokens())

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def free(self, seq: Sequence) -> None:
        """Drop `seq` from the queues and return its pages (finish, abort or error)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.alloc.release(seq.pages)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.alloc.release(seq.pages)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _pick_owner(self, seq: Sequence) -> int:
        """Owning rank for DP/DOP: the one with the most free pages (ties: lowest rank)."""
        free = self.alloc.num_free
        return max(range(len(free)), key=lambda r: (free[r], -r))

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        budget = self.cfg.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        taken: set[int] = set()
        preempted = False

        order = [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            k = min(seq.num_tokens - seq.num_computed, budget)
            if k <= 0:
                continue  # nothing new to feed (its last sampled token is still pending)
            while not self.alloc.can_grow(seq.pages, seq.num_computed + k, seq.owner):
                victim = next(s for s in reversed(self.running) if s.seq_id not in taken)
                if victim is seq and len(self.running) == 1:
                    # Alone and still out of room: this sequence has filled the whole pool.
                    self.running.remove(seq)
                    self.alloc.release(seq.pages)
                    seq.finish("length")
                    self.finished_by_scheduler.append(seq)
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.alloc.grow(seq.pages, seq.num_computed + k, seq.owner)
            picked.append((seq, k))
            taken.add(seq.seq_id)
            budget -= k

        # Admit queued sequences, oldest first; not in a step that had to preempt (they would thrash).
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.num_tokens > self.max_seq_tokens():
                # A preempted sequence that grew past what the pool can ever hold again.
                self.waiting.popleft()
                seq.finish("length")
                self.finished_by_scheduler.append(seq)
                continue
            owner = self._pick_owner(seq)
            if not self.alloc.can_grow(self.alloc.empty_table(), seq.num_tokens, owner):
                break  # the pool cannot hold it yet: keep it (and everyone behind it) queued
            self.waiting.popleft()
            k = min(seq.num_tokens - seq.num_computed, budget)
            seq.owner = owner
            seq.status = SeqStatus.RUNNING
            self.alloc.grow(seq.pages, seq.num_computed + k, owner)
            self.running.append(seq)
            picked.append((seq, k))
            taken.add(seq.seq_id)
            budget -= k

        slices: list[SeqSlice] = []
        ids: list[int] = []
        for seq, k in picked:
            start = seq.num_computed
            ids.extend(seq.token_slice(start, start + k))
            slices.append(SeqSlice(req_id=seq.seq_id, start=start, num_new=k, owner=seq.owner,
                                   pages=[row[:] for row in seq.pages],
                                   sample=start + k == seq.num_tokens))
        plan = StepPlan(step=self.step_no, layout=self.layout, input_ids=ids, seqs=slices)
        self.step_no += 1
        return ScheduledStep(plan=plan, seqs=[s for s, _ in picked])

    def complete(self, step: ScheduledStep) -> None:
        """The step ran: its rows are now in the KV cache."""
        for seq, sl in zip(step.seqs, step.plan.seqs):
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed = sl.start + sl.num_new
