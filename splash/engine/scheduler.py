"""Continuous batching with chunked prefill, a per-step token budget and preemption by recompute.

Each step: running sequences first (decodes, then unfinished prefill chunks), each growing its page
table for the rows it gets; every sequence's rows count against one per-step budget
(`max_num_batched_tokens`, vLLM's semantics: decode rows and prefill chunks alike), and a prompt's
chunk is further capped at `long_prefill_token_threshold` tokens per step when that is set (vLLM's
flag: several prompts then share a step's budget instead of the oldest taking all of it). Decodes go
first, so a step never holds a running stream back for a prompt: the budget bounds how much prefill
rides along with them (the TTFT/ITL trade-off, docs/performance.md). A sequence that cannot grow
preempts the most recently admitted one not yet scheduled this step (its pages are freed and it goes
back to the front of the queue, to be recomputed from prompt + generated tokens). Then queued sequences
are admitted while the budget, the `max_num_seqs` bound and the real per-rank free pages allow (a
queued sequence is admitted only if the pool could hold every token it already has, so its own
prefill never preempts anyone). A KDA model's sequence also needs a state slot (`alloc.slots`): taken
at admission (no free slot: it stays queued), given back with its pages at finish, abort or preemption
(a preempted sequence recomputes its state from its tokens, from a zeroed slot, when readmitted).

Under DP/DOP each sequence is owned by one rank, chosen at admission: among the ranks whose free pages
hold the sequence now, the one with the least *projected* KV - the pages its running sequences will
need at prompt + max_tokens - so ranks stay balanced as requests grow, not just as they arrive.

A decode engine of prefill/decode disaggregation (splash/engine/stages/pd.py) *parks* sequences: pages
reserved for a prompt whose KV another engine writes, counted by the books, never scheduled, until the
KV arrives (`admit_computed`: running, prompt computed). One aborted while parked *drains*: its pages
stay held `drain_s` seconds, since a late write may still land in them.

(Over ~450 lines on purpose: admission, owner choice, charging, preemption and the parked path all
read and change the same page and charge books, which `book_errors` proves; split apart they would each
need the others' internals.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from splash.config import EngineConfig
from splash.engine.request import SeqStatus, Sequence
from splash.kv.allocator import KVAllocator, balanced_owners, pages_for
from splash.kv.books import Holder, book_errors
from splash.kv.prefix import Block, PrefixCache
from splash.kv.snapshots import cut_chunk, save_snapshot, snapshot_end, state_prefix
from splash.step.plan import SeqSlice, StepPlan

# A request goes to the rank holding its longest cached prefix (DP/DOP) unless that rank's projected
# pages would exceed the least-loaded rank's by more than this many times the request's own projected
# pages: a GRPO group of up to 16 samples stays on one owner, and new groups still go where it is light.
PREFIX_BALANCE = 16


@dataclass
class SchedulerConfig:
    """The scheduler's bounds: the engine's are its resolved config's (`of`), tests give their own."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # > 0: at most this many prompt tokens per sequence per step

    def __post_init__(self) -> None:
        for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        v = self.long_prefill_token_threshold
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"long_prefill_token_threshold must be 0 (off) or a positive integer, got {v!r}")

    @classmethod
    def of(cls, config: EngineConfig) -> SchedulerConfig:
        """The bounds of a resolved `EngineConfig` (`resolved`: every one filled), read by field name."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def chunk(self, pending: int, budget: int) -> int:
        """Rows a sequence with `pending` uncomputed tokens gets in a step with `budget` left."""
        cap = self.long_prefill_token_threshold
        if 0 < cap < pending:
            pending = cap
        return min(pending, budget)


@dataclass
class ScheduledStep:
    """A plan plus the sequences behind its slices (same order), kept on rank 0 only."""

    plan: StepPlan
    seqs: list[Sequence]
    # speculative decoding: the drafts each verify slice checks (after its known row), by sequence
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)
    executed: bool = False  # the ranks ran the plan (a failure after this cannot be undone on them)

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
        self.prompt_tokens_computed = 0  # prompt positions run through the model (recomputes counted)
        # Sequences the scheduler itself ended (context full with nobody left to preempt); the engine
        # drains this to report them.
        self.finished_by_scheduler: list[Sequence] = []
        # Projected pages per owner rank of the running sequences (DP/DOP owner choice), and what each
        # running sequence was charged, so leaving returns exactly that.
        self.projected = [0] * alloc.world
        self._charged: dict[int, tuple[int, int]] = {}
        # Sequences whose pages were released since the last plan with rows: the next such plan tells
        # the ranks to forget their tables (StepPlan.dropped).
        self.dropped: list[int] = []
        # Speculative decoding (splash/engine/spec.py): drafts for a decoding sequence, or None (off).
        self.proposer: Callable[[Sequence, int], list[int]] | None = None
        # Prefill/decode disaggregation, decode side (splash/engine/stages/pd.py): sequences holding
        # pages (and a slot) for a prompt whose KV another engine writes; neither queued nor scheduled.
        self.parked: list[Sequence] = []
        # ... and those aborted while parked: the other engine may still write into their pages, so they
        # are held `drain_s` seconds more before they are reused (seq id -> (sequence, until)).
        self.draining: dict[int, tuple[Sequence, float]] = {}
        self.drain_s = 0.0

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
        self.uncharge(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.parked:
            self.parked.remove(seq)
            if self.drain_s > 0:
                self.draining[seq.seq_id] = (seq, time.monotonic() + self.drain_s)
                return
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.dropped.append(seq.seq_id)
        self.alloc.release(seq.pages)
        seq.cached_blocks = []
        if seq.slot >= 0 and self.alloc.slots is not None:
            self.alloc.slots.free(seq.slot)
        seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.uncharge(seq)
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def projected_pages(self, seq: Sequence) -> int:
        """Pages `seq` will hold when done: prompt + max_tokens, capped by the context."""
        p = seq.params
        limit = self.cfg.max_model_len if p.max_tokens is None else len(seq.prompt_token_ids) + p.max_tokens
        return pages_for(max(seq.num_tokens, min(limit, self.cfg.max_model_len)), self.alloc.page_size)

    def charge(self, seq: Sequence) -> None:
        """Count a running sequence's projected pages against its owner (what `_pick_owner` balances)."""
        n = self.projected_pages(seq)
        self._charged[seq.seq_id] = (seq.owner, n)
        self.projected[seq.owner] += n

    def uncharge(self, seq: Sequence) -> None:
        """Return exactly what `charge` counted for `seq` (nothing if it was not charged)."""
        owner, n = self._charged.pop(seq.seq_id, (0, 0))
        self.projected[owner] -= n

    def set_owner(self, seq: Sequence, owner: int) -> None:
        """Move a running sequence to another owner rank (a switch did), its charge with it."""
        if seq.owner != owner:
            self.uncharge(seq)
            seq.owner = owner
            self.charge(seq)

    def _pick_owner(self, seq: Sequence) -> int | None:
        """Owner for DP/DOP by the one owner rule (`balanced_owners`): among ranks that can hold `seq`
        now, the least projected load (ties: most free pages, then lowest rank); None if no rank can.
        TP/CP ignore owners: always 0."""
        empty = self.alloc.empty_table()
        if not self.alloc.core_layout.owned:
            return 0 if self.alloc.can_grow(empty, seq.num_tokens, 0) else None
        lacks = [self.alloc.demand(empty, seq.num_tokens, r)[r] for r in range(self.alloc.world)]
        owners, stuck, _ = balanced_owners([0], [lacks], self.alloc.num_free, [seq.seq_id], self.projected)
        return None if stuck is not None else owners[0]

    def _cached(self, seq: Sequence, cache: PrefixCache) -> tuple[int, list[Block]] | None:
        """Owner and cached prefix blocks for `seq` (prefix cache on); None while it must wait: no rank
        can hold it, or its next prefix page is being computed by another request (share that prefill).
        DP/DOP: the owner holding the longest prefix, unless that unbalances the owners beyond
        PREFIX_BALANCE (then the one owner rule, and what that owner has cached)."""
        alloc = self.alloc
        keys = self._keys(seq, cache, PrefixCache.reusable_pages(seq.num_tokens, alloc.page_size))
        if not alloc.core_layout.owned:
            blocks, wait = self._match(cache, keys)
            return None if wait or not self._fits(cache, blocks, seq, 0) else (0, blocks)
        best: tuple[int, list[Block], bool] | None = None
        for r in range(alloc.world):
            blocks, wait = self._match(cache, keys, lambda b, r=r: b.column[r] >= 0)
            if best is None or len(blocks) > len(best[1]):
                best = (r, blocks, wait)
        assert best is not None
        r, blocks, wait = best
        mine = self.projected_pages(seq)
        if blocks and self.projected[r] - min(self.projected) <= PREFIX_BALANCE * mine \
                and self._fits(cache, blocks, seq, r):
            return None if wait else (r, blocks)
        owner = self._pick_owner(seq)
        if owner is None:
            return None
        blocks, wait = self._match(cache, keys, lambda b: b.column[owner] >= 0)
        if wait:
            return None
        return owner, blocks if self._fits(cache, blocks, seq, owner) else []

    def _match(self, cache: PrefixCache, keys: list[bytes], holds: object = None) -> tuple[list[Block], bool]:
        """`cache.match`, cut back for a KDA hybrid to the longest prefix ending at a state snapshot."""
        blocks, wait = cache.match(keys, holds)
        return state_prefix(blocks, self.alloc.slots is not None), wait

    def _snap_cap(self, seq: Sequence, k: int) -> int:
        """A hybrid's prefill chunk ends at its prompt's snapshot point (kv/snapshots.py) when no block
        there holds a snapshot yet, so the state at that point can be kept."""
        cache = self.alloc.cache
        if cache is None or cache.snaps is None or seq.slot < 0:
            return k
        end = snapshot_end(seq.num_tokens, self.alloc.page_size)
        start = seq.num_computed
        if not start < end < start + k:
            return k
        b = cache.blocks.get(self._keys(seq, cache, end // self.alloc.page_size)[-1])
        return k if b is not None and b.snap >= 0 else cut_chunk(start, k, end)

    def _offer(self, seq: Sequence) -> None:
        """Register the pages `seq` now holds whose tokens are all known (not yet computed: not ready)."""
        P = self.alloc.page_size
        self._register(seq, min(PrefixCache.reusable_pages(seq.num_tokens, P), len(seq.pages[0])))

    def _fits(self, cache: PrefixCache, blocks: list[Block], seq: Sequence, owner: int) -> bool:
        """Whether `seq` fits on `owner` starting from `blocks`: held, they are no longer evictable."""
        cache.take(blocks)
        try:
            table = [[b.column[r] for b in blocks] for r in range(self.alloc.world)]
            return self.alloc.can_grow(table, seq.num_tokens, owner)
        finally:
            cache.untake(blocks)

    def _keys(self, seq: Sequence, cache: PrefixCache, n: int) -> list[bytes]:
        """The chain keys of `seq`'s first `n` pages; those not yet known are hashed once and kept."""
        keys, P = seq.block_keys, self.alloc.page_size
        if len(keys) < n:
            have = len(keys)
            keys += cache.keys(seq.token_slice(have * P, n * P), n - have, keys[-1] if keys else b"")
        return keys[:n]

    def _register(self, seq: Sequence, upto: int) -> None:
        """Offer `seq`'s pages [len(seq.cached_blocks), upto) to the prefix cache (their keys known).
        A sequence admitted before the cache was invalidated (a weight update) offers nothing: its
        new pages attend to KV of the old weights, so they stay private."""
        cache = self.alloc.cache
        assert cache is not None
        if seq.cache_epoch != cache.epoch:
            seq.cached_blocks += [None] * (upto - len(seq.cached_blocks))
            return
        keys = self._keys(seq, cache, upto)
        while len(seq.cached_blocks) < upto:
            j = len(seq.cached_blocks)
            b = cache.register(keys[j], j, [row[j] for row in seq.pages])
            seq.cached_blocks.append(b)  # None: another block had the key, the page stays private

    def _victim(self, seq: Sequence, tokens: int, taken: set[int]) -> Sequence | None:
        """Whom to preempt so `seq` can grow: the most recently admitted sequence not scheduled yet this
        step that holds pages on a rank short of room (preempting others frees nothing useful); `seq`
        itself if only it is left there; None if `seq` alone holds such a rank (it cannot grow)."""
        need = self.alloc.demand(seq.pages, tokens, seq.owner)
        free = self.alloc.num_free
        short = [r for r in range(self.alloc.world) if need[r] > free[r]]
        for s in reversed(self.running):
            if s is seq or s.seq_id in taken:
                continue
            if any(p >= 0 for r in short for p in s.pages[r]):
                return s
        others = any(any(p >= 0 for r in short for p in s.pages[r]) for s in self.running if s is not seq)
        return seq if others else None

    # ---- the books ------------------------------------------------------------------------------
    def holders(self) -> dict[int, Holder]:
        """Every queued or running sequence's holdings, for the books (splash/kv/books.py)."""
        drained = (seq for seq, _ in self.draining.values())
        return {s.seq_id: Holder(s.pages, s.owner, s.slot, s.cached_blocks)
                for s in (*self.running, *self.waiting, *self.parked, *drained)}

    def book_errors(self) -> list[str]:
        """What disagrees in the allocator's books, or in the scheduler's own: a queued sequence holds
        nothing, a running one is charged once, and the owners' projected pages add up."""
        errs = book_errors(self.alloc, self.holders())
        for s in self.waiting:
            if any(s.pages) or s.slot >= 0 or s.seq_id in self._charged:
                errs.append(f"queued seq {s.seq_id} holds pages, a slot or a charge")
        for s in self.running:
            c = self._charged.get(s.seq_id)
            if c is None or c[0] != s.owner:
                errs.append(f"running seq {s.seq_id} is not charged to its owner {s.owner}")
            if self.alloc.slots is not None and s.slot < 0:
                errs.append(f"running seq {s.seq_id} has no state slot")
        if len({s.seq_id for s in self.running} | {s.seq_id for s in self.waiting}) \
                != len(self.running) + len(self.waiting):
            errs.append("a sequence is both queued and running, or listed twice")
        load = [0] * self.alloc.world
        for owner, n in self._charged.values():
            load[owner] += n
        if load != self.projected:
            errs.append(f"projected pages per owner {self.projected} != the charges {load}")
        return errs

    # ---- prefill/decode disaggregation, decode side ----------------------------------------------
    def reserve(self, seq: Sequence, headroom: int = 0) -> bool:
        """Hold pages for `seq`'s prompt (and a KDA slot) while another engine writes its KV: parked,
        not scheduled, until `admit_computed`. Only while `headroom` more pages stay free (room for the
        running sequences to grow). False: no room now (try again after some step)."""
        if self.draining:
            self.expire()
        owner = self._pick_owner(seq)
        n = len(seq.prompt_token_ids)
        if owner is None or not self.alloc.can_grow(self.alloc.empty_table(), n, owner, headroom):
            return False
        slots = self.alloc.slots
        if slots is not None and slots.num_free == 0:
            return False
        seq.owner = owner
        self.alloc.grow(seq.pages, n, owner)
        if slots is not None:
            seq.slot = slots.alloc()
        seq.status = SeqStatus.RUNNING
        self.parked.append(seq)
        return True

    def unpark(self, seq: Sequence) -> None:
        """Forget that `seq` is parked (nothing will write into its pages any more): freeing it then
        returns them at once, not after `drain_s`."""
        self.parked.remove(seq)

    def expire(self, now: float | None = None) -> None:
        """Return the pages of drained sequences whose time is up (all of them with `now` = inf)."""
        now = time.monotonic() if now is None else now
        for sid, (seq, until) in list(self.draining.items()):
            if until <= now:
                del self.draining[sid]
                self._release(seq)

    def admit_computed(self, seq: Sequence) -> None:
        """A parked sequence's KV arrived: it runs from here with its prompt computed. Its prompt pages
        stay private (never offered to the prefix cache: their blocks were not computed here)."""
        self.parked.remove(seq)
        seq.num_computed = len(seq.prompt_token_ids)
        cache = self.alloc.cache
        if cache is not None:
            seq.cached_blocks = [None] * (seq.num_computed // self.alloc.page_size)
            seq.cache_epoch = cache.epoch
        self.charge(seq)
        self.running.append(seq)

    def _draft(self, seq: Sequence, k: int, budget: int) -> list[int]:
        """Drafts to verify with `seq`'s next row: only in decode (one known row), within the step's
        token budget and the context, and only where its pages can grow without preempting anyone."""
        if self.proposer is None or k != 1 or seq.num_tokens - seq.num_computed != 1 or budget < 2:
            return []
        room = min(budget - 1, self.cfg.max_model_len - seq.num_tokens)
        draft = self.proposer(seq, room) if room > 0 else []
        while draft and not self.alloc.can_grow(seq.pages, seq.num_computed + 1 + len(draft), seq.owner):
            draft = draft[:-1]
        return draft

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        if self.draining:
            self.expire()
        budget = self.cfg.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        drafts: dict[Sequence, list[int]] = {}
        taken: set[int] = set()
        preempted = False

        order = [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            k = self._snap_cap(seq, self.cfg.chunk(seq.num_tokens - seq.num_computed, budget))
            if k <= 0:
                continue  # nothing new to feed (its last sampled token is still pending)
            while not self.alloc.can_grow(seq.pages, seq.num_computed + k, seq.owner):
                victim = self._victim(seq, seq.num_computed + k, taken)
                if victim is None:
                    # The only holder of a rank that is out of room: it has filled that whole pool.
                    self.uncharge(seq)
                    self.running.remove(seq)
                    self._release(seq)
                    seq.finish("length")
                    self.finished_by_scheduler.append(seq)
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            draft = self._draft(seq, k, budget)
            if draft:
                drafts[seq] = draft
            end = seq.num_computed + k + len(draft)
            self.alloc.shrink(seq.pages, end)  # (pages an earlier verify's rejected rows reached into)
            self.alloc.grow(seq.pages, end, seq.owner)
            if self.alloc.cache is not None:
                self._offer(seq)
            picked.append((seq, k))
            taken.add(seq.seq_id)
            budget -= k + len(draft)

        # Admit queued sequences, oldest first; not in a step that had to preempt (they would thrash).
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.num_tokens > self.max_seq_tokens():
                # A preempted sequence that grew past what the pool can ever hold again.
                self.waiting.popleft()
                seq.finish("length")
                self.finished_by_scheduler.append(seq)
                continue
            cache = self.alloc.cache
            blocks: list[Block] = []
            if cache is None or seq.params.needs_prompt_rows:
                owner = self._pick_owner(seq)
            else:
                got = self._cached(seq, cache)
                owner, blocks = (None, []) if got is None else got
            if owner is None:
                break  # no rank can hold it yet: keep it (and everyone behind it) queued
            slots = self.alloc.slots
            if slots is not None and slots.num_free == 0:
                break  # every state slot is held (KDA): queued until a running sequence leaves
            self.waiting.popleft()
            if slots is not None:
                seq.slot = slots.alloc()
            if cache is not None:
                cache.take(blocks)
                cache.queries += seq.num_tokens
                cache.hits += len(blocks) * self.alloc.page_size
                if not seq.pages:  # (a preempted sequence keeps its emptied rows)
                    seq.pages.extend([] for _ in range(self.alloc.world))
                for r in range(self.alloc.world):
                    seq.pages[r].extend(b.column[r] for b in blocks)
                seq.cached_blocks = list(blocks)
                seq.cache_epoch = cache.epoch
                seq.num_computed = len(blocks) * self.alloc.page_size
                seq.num_cached_tokens = seq.num_computed
                if blocks and cache.snaps is not None:  # a hybrid starts from the prefix's state
                    cache.snaps.load(blocks[-1], seq.slot)
            k = self._snap_cap(seq, self.cfg.chunk(seq.num_tokens - seq.num_computed, budget))
            seq.owner = owner
            self.charge(seq)
            seq.status = SeqStatus.RUNNING
            self.alloc.grow(seq.pages, seq.num_computed + k, owner)
            if cache is not None:  # the prompt pages it is about to compute, as blocks not yet ready
                self._offer(seq)
            self.running.append(seq)
            picked.append((seq, k))
            taken.add(seq.seq_id)
            budget -= k

        slices: list[SeqSlice] = []
        ids: list[int] = []
        num_sample: list[int] | None = None
        for i, (seq, k) in enumerate(picked):
            start = seq.num_computed
            ids.extend(seq.token_slice(start, start + k))
            draft = drafts.get(seq, ())
            if draft:  # a verify slice: the last token and the drafts, logits for every row
                ids.extend(draft)
                if num_sample is None:
                    num_sample = [1] * len(picked)
                num_sample[i] = 1 + len(draft)
            # `pages` is the sequence's live table, not a copy (rank 0 reads it while the step runs;
            # copying every table every step was O(pages)): later steps grow it, a release empties it.
            slices.append(SeqSlice(req_id=seq.seq_id, start=start, num_new=k + len(draft),
                                   owner=seq.owner, pages=seq.pages, sample=start + k == seq.num_tokens,
                                   slot=seq.slot))
        dropped: list[int] = []
        if slices:  # a plan without rows never runs: its drops wait for the next one
            dropped, self.dropped = self.dropped, []
        plan = StepPlan(step=self.step_no, layout=self.layout, input_ids=ids, seqs=slices, dropped=dropped,
                        num_sample=num_sample)
        self.step_no += 1
        return ScheduledStep(plan=plan, seqs=[s for s, _ in picked], drafts=drafts)

    def complete(self, step: ScheduledStep) -> None:
        """The step ran: its rows are now in the KV cache (and its full prefix pages ready to share). A
        verify slice counts its known row only; `accept` adds the drafts the sampler accepted."""
        drafts = step.drafts
        for seq, sl in zip(step.seqs, step.plan.seqs):
            if seq.status is SeqStatus.RUNNING:
                self._computed(seq, sl.start, sl.start + sl.num_new - len(drafts.get(seq, ())))

    def rewind(self, seq: Sequence, computed: int) -> None:
        """`seq`'s state from `computed` on is recomputed (a KDA hybrid's rejected drafts: its state was
        put back to before the verify); its pages stay, and are rewritten with the same values."""
        if seq.status is SeqStatus.RUNNING:
            seq.num_computed = computed

    def accept(self, seq: Sequence, n: int) -> None:
        """`n` of `seq`'s verified drafts were accepted: their rows' KV is now the sequence's."""
        if seq.status is SeqStatus.RUNNING and n > 0:
            self._computed(seq, seq.num_computed, seq.num_computed + n)

    def _computed(self, seq: Sequence, start: int, end: int) -> None:
        seq.num_computed = end
        n = len(seq.prompt_token_ids)
        self.prompt_tokens_computed += max(0, min(end, n) - min(start, n))
        if self.alloc.cache is not None:
            P = self.alloc.page_size
            full = end // P
            if full > len(seq.cached_blocks):  # generated pages too (a conversation's next turn)
                self._register(seq, full)
            # the pages rows start..end completed: those from the one its first row fell in
            for b in seq.cached_blocks[start // self.alloc.page_size:full]:
                if b is not None:
                    b.ready = True
            cache = self.alloc.cache
            if cache.snaps is not None and seq.slot >= 0 and end == snapshot_end(seq.num_tokens, P) > 0 \
                    and seq.cache_epoch == cache.epoch:  # a hybrid's state at its prompt's snapshot point
                save_snapshot(cache, self._keys(seq, cache, end // P)[-1], seq.slot, seq.owner,
                              self.alloc.core_layout.state_placement.value == "owner")
