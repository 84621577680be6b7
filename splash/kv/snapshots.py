"""The prefix cache of KDA hybrids: snapshots of a request's KDA state kept with cached prefix blocks.

Design (issue 49). A hybrid's request keeps, besides its MLA pages, a KDA recurrent state and conv
window (splash/kv/state.py) that a prefix's pages cannot rebuild: to skip computing a prompt's first
m*P tokens, a request needs the state *at position m*P*. So:

- **Where snapshots are taken**: at the end of each prompt's cacheable part, b = ((N - 1) // P) * P (the
  last full-page boundary a hitting request may use: its last token is always computed, prefix.py's
  rule), as SGLang keeps a Mamba state at the end of each prompt's cached part. The cache matches full
  pages only, so a prefill chunk must end exactly there: the scheduler cuts a chunk that would cross b
  (`Scheduler._snap_cap`), which costs a prompt at most one more chunk (of <= P tokens). Boundaries
  crossed mid-prompt are not snapshotted (each snapshot is a whole state, ~MBs on real shapes: one per
  prompt serves GRPO groups, and an agent's next turn hits its previous prompt's end).
- **The snapshot pool**: extra rows of every rank's `StatePool`, after the live slots (indices
  `base .. base + count - 1`), so a snapshot is placed exactly like live state (head-sharded in TP/DOP,
  on the owner in DP, replicated in CP: `stores.state_share`) and a copy slot <-> snapshot is the same
  row copy on every rank. Its own budget (`--num-state-snapshots`, default the live slots' count),
  reserved from the KV budget with the slots (`worker/load.py`). Rank 0 keeps the rows' books here:
  a free list, which block each row belongs to (`Block.snap`), an LRU, and the pending row copies.
- **Referenced from the prefix cache's block** at page b/P - 1 (the chain key names the whole prefix),
  freed with it (eviction, flush, invalidation: `PrefixCache._forget`); when no row is free, the least
  recently used snapshot is dropped (its block stays, now without state).
- **A hit**: the scheduler's match is cut back to the longest prefix whose last block has a snapshot
  (none: a miss, computed from position 0); the request copies the row into its slot and prefills only
  the rest. In DP the row is on the block's holder, the owner the match chose (a snapshot is only
  attached to a block on the saving request's owner).
- **Copies reach the ranks** before the next forward step, in the order rank 0 made them (a save, then
  a load of the same row, may be in one batch): the `Snapshots` stage sends them as one "state" control
  message (`runner.copy_state`). A save is queued when the step ending at b completes, so it copies the
  slot before any later step changes it, even if its request is preempted or aborted meanwhile.
- **Events**: a weight update / flush / memory release drops every snapshot with the index
  (`invalidate`, counted in `dropped`). A live switch first flushes the unreferenced blocks (their
  snapshots go with them, as their pages do), then moves the rows of the held blocks' snapshots in the
  same all-to-all as live slots, by the same rule (`core.holdings.state_block_arrays`: re-headed for
  TP/DOP, gathered for CP, to the block's holder in DP, `holder`): the switch planner's `_snapshots`.
  Copies queued before the switching step run before it (this stage precedes the switch's), so the
  rows it moves hold what was saved. Speculation's verify snapshot (`StatePool.arm_snapshot`) is
  separate and unaffected.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def snapshot_rows(hybrid: bool, prefix_cache: bool, asked: int | None, slots: int) -> int:
    """State rows a rank keeps for prefix snapshots: `asked` (`--num-state-snapshots`), else as many as
    live slots; 0 for a model without KDA state or without the prefix cache."""
    if not hybrid or not prefix_cache:
        return 0
    return slots if asked is None else max(0, int(asked))


class SnapshotPool:
    """Rank 0's books of the snapshot rows `base .. base + count - 1` of every rank's StatePool."""

    def __init__(self, base: int, count: int) -> None:
        self.base, self.count = base, count
        self._free = list(range(base + count - 1, base - 1, -1))
        self._owner: dict[int, Any] = {}  # row -> the block it is the state of
        self._lru: OrderedDict[int, None] = OrderedDict()  # held rows, least recently used first
        self.pending: list[tuple[int, int]] = []  # (source row, destination row) copies not yet sent
        self.saved = 0  # snapshots taken
        self.loaded = 0  # requests that started from one (prefix hits of a hybrid)
        self.evicted = 0  # dropped for room (LRU) or with their block
        self.dropped = 0  # dropped by an invalidation (weight update, flush of the index, release)
        self.carried = 0  # carried through a layout switch (one per snapshot and switch)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def save(self, slot: int, block: Any) -> bool:
        """Take a snapshot of `slot` (its state now) as `block`'s; the LRU row goes if none is free.
        False when the pool has no rows at all."""
        if block.snap >= 0 or self.count == 0:
            return False
        if not self._free:
            self.release(self._owner[next(iter(self._lru))])
            self.evicted += 1
        row = self._free.pop()
        self._owner[row] = block
        self._lru[row] = None
        block.snap = row
        self.pending.append((slot, row))
        self.saved += 1
        return True

    def load(self, block: Any, slot: int) -> None:
        """A request admitted into `slot` starts from `block`'s snapshot."""
        row = block.snap
        if self._owner.get(row) is not block:
            raise RuntimeError(f"snapshot row {row} is not its block's (prefix snapshot bookkeeping bug)")
        self._lru.move_to_end(row)
        self.pending.append((row, slot))
        self.loaded += 1

    def release(self, block: Any) -> None:
        """`block` leaves (evicted, flushed, invalidated) or loses its snapshot: the row is free."""
        row = block.snap
        if row < 0:
            return
        block.snap = -1
        if self._owner.pop(row, None) is not block:
            raise RuntimeError(f"snapshot row {row} freed by a block that does not hold it (bookkeeping bug)")
        self._lru.pop(row, None)
        self._free.append(row)

    def drop(self, blocks: Any) -> None:
        """Every snapshot of `blocks` goes (an invalidation): counted as dropped."""
        for b in blocks:
            if b.snap >= 0:
                self.release(b)
                self.dropped += 1

    def take_pending(self) -> list[tuple[int, int]]:
        out, self.pending = self.pending, []
        return out

    def errors(self, live: Any) -> list[str]:
        """What disagrees in these books given the cache's live blocks (empty: they balance): every row
        free or held by exactly the one block that names it, held rows on the LRU, no row twice."""
        errs: list[str] = []
        free = self._free
        rows = set(range(self.base, self.base + self.count))
        if len(set(free)) != len(free) or not set(free) <= rows:
            errs.append("a snapshot row is on the free list twice or out of range")
        if set(free) & set(self._owner):
            errs.append(f"snapshot rows {sorted(set(free) & set(self._owner))[:4]} are both free and held")
        if set(free) | set(self._owner) != rows:
            errs.append(f"leaked snapshot rows {sorted(rows - set(free) - set(self._owner))[:4]}")
        if set(self._lru) != set(self._owner):
            errs.append("the snapshot LRU does not list exactly the held rows")
        named = {}
        for b in live:
            if b.snap >= 0:
                if b.snap in named:
                    errs.append(f"snapshot row {b.snap} is named by two blocks")
                named[b.snap] = b
                if not b.indexed:
                    errs.append(f"snapshot row {b.snap} belongs to a stale block (never matched again)")
        if {r: id(b) for r, b in named.items()} != {r: id(b) for r, b in self._owner.items()}:
            errs.append("snapshot rows held and the blocks naming them disagree")
        return errs

    def stats(self) -> dict[str, int]:
        return {"prefix_snapshots_used": self.num_used, "prefix_snapshots_total": self.count,
                "prefix_snapshots_saved": self.saved, "prefix_snapshot_hits": self.loaded,
                "prefix_snapshots_evicted": self.evicted, "prefix_snapshots_dropped": self.dropped,
                "prefix_snapshots_moved": self.carried}


def holder(column: Any) -> int:
    """The rank a block's snapshot sits on where state is placed on the owner (DP-attention): the rank
    holding the block's page there (one; 0 if none). Elsewhere state does not follow owners."""
    return next((r for r, p in enumerate(column) if p >= 0), 0)


# ---- the scheduler's three rules (splash/engine/scheduler.py asks them) -----------------------------------
def state_prefix(blocks: list[Any], stateful: bool) -> list[Any]:
    """A match cut back to what a request with per-request state can start from: the longest prefix
    whose last block holds a snapshot (none: a miss). Models without state take the whole match."""
    if not stateful:
        return blocks
    n = len(blocks)
    while n and blocks[n - 1].snap < 0:
        n -= 1
    return blocks[:n]


def snapshot_end(tokens: int, page_size: int) -> int:
    """b: where a prompt of `tokens` tokens is snapshotted (its last full page a hit may reuse; 0: none)."""
    return max(0, tokens - 1) // page_size * page_size


def cut_chunk(start: int, k: int, end: int) -> int:
    """A prefill chunk of `k` rows from `start`, ended at the snapshot point `end` if it would cross it."""
    return end - start if start < end < start + k else k


def save_snapshot(cache: Any, key: bytes, slot: int, owner: int, owner_placed: bool) -> bool:
    """A request's state in `slot` is now its state at the end of the prefix `key` (a step ended at its
    snapshot point): keep it with that prefix's block, if the block is indexed, ready, has none yet and
    (`owner_placed`: DP keeps state on the owner only) sits on the request's owner."""
    snaps = cache.snaps
    b = cache.blocks.get(key)
    if snaps is None or b is None or not b.ready or b.snap >= 0:
        return False
    if owner_placed and b.column[owner] < 0:
        return False
    return snaps.save(slot, b)
