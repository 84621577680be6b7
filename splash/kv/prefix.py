"""The prefix cache: full KV pages matched by content, shared by reference count, evicted LRU.

Rank 0 only (it owns the allocators; ranks only ever see page ids in their tables, shared or not).
A *block* is one full page of a request's KV at global page index j (positions [j*P, (j+1)*P)): its
column of local page ids (one per rank, -1 where the layout does not place it: every rank in TP, the
owner in DP/DOP, rank j % T in CP), the number of live tables that hold it, and whether its KV is
computed yet. Blocks are found by a hash chain, key_j = H(key_{j-1}, tokens of page j), so a key names
a whole prefix (vLLM's automatic prefix caching); a hash chain rather than a radix tree because full
pages are the unit everything else counts (allocator, manifests, switches) and a chain lookup is one
dict probe per page.

Rules (the one place they are written):
- only full pages are shared, and a request reuses at most its first (tokens - 1) // P pages: its last
  token is always computed (for its logits), in a page of its own, so a shared page is never written;
- a block is usable once ready (its prefill step completed); a request whose next page is a block
  still being computed waits for it instead of computing it again (the n samples of a prompt share one
  prefill);
- a block holds its pages while any table does; at zero it stays cached and evictable (LRU, deepest
  page first), and `free` / `grow` of the allocator take evictable pages when the free list runs short;
- a block not ready when its last holder leaves is dropped (its KV was never completed);
- `invalidate` (a weight update, a memory release) takes every block out of the index at once, so a
  page computed with the old weights is never matched again: unreferenced blocks are freed there and
  then, held ones stay *stale* (still reference-counted, never matched, never evictable) and their
  pages go back exactly once, when their last holder lets go. A sequence admitted before the
  invalidation registers no further pages (`epoch`): what it computes next attends to old-weight KV;
- a layout switch drops the unreferenced blocks first (their pages freed, not moved: cached history
  nobody holds is not worth a transfer on the switching step) and moves every held block once, with
  its holders (`moved`): keys, reference counts and readiness survive the switch;
- KDA hybrids: a block may carry a snapshot of the state at its end (`snap`, splash/kv/snapshots.py),
  freed with the block; an invalidation drops every snapshot, a switch moves them with live state.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from splash.kv.snapshots import SnapshotPool


@dataclass
class Block:
    key: bytes
    index: int  # global page index in every table that holds it
    column: tuple[int, ...]  # local page per rank, -1 where not placed
    refs: int = 0
    ready: bool = False
    indexed: bool = True  # in the index (matchable); False: stale, kept only for its holders
    snap: int = -1  # KDA hybrids: the state row of the state at this page's end (kv/snapshots.py)


class PrefixCache:
    """Blocks of one engine, keyed by hash chain; the allocator asks it to free and evict pages."""

    def __init__(self, page_size: int, world: int) -> None:
        self.page_size, self.world = page_size, world
        self.blocks: dict[bytes, Block] = {}  # the index: what `match` can find
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # indexed, refs == 0, oldest first
        # rank -> local page -> the block holding it (indexed or stale): every page a block owns
        self._page: list[dict[int, Block]] = [{} for _ in range(world)]
        self.epoch = 0  # invalidations so far; a sequence registers pages only in its admission's epoch
        self._evictable = [0] * world  # pages per rank held by blocks in the LRU
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found (vLLM's prefix_cache_hits)
        # KDA hybrids: the state snapshots kept with blocks (splash/kv/snapshots.py), else None
        self.snaps: SnapshotPool | None = None

    # ---- keys -------------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], pages: int, prev: bytes = b"") -> list[bytes]:
        """Chain keys of the first `pages` full pages of `tokens` (prev: the key of the page before)."""
        P, out = self.page_size, []
        arr = np.asarray(tokens[:pages * P], dtype=np.int64)
        for j in range(pages):
            prev = hashlib.blake2b(prev + arr[j * P:(j + 1) * P].tobytes(), digest_size=16).digest()
            out.append(prev)
        return out

    @staticmethod
    def reusable_pages(tokens: int, page_size: int) -> int:
        """Pages a request of `tokens` tokens may take from the cache: its last token stays its own."""
        return max(0, tokens - 1) // page_size

    # ---- lookup -----------------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], holds: object = None) -> tuple[list[Block], bool]:
        """The longest run of ready blocks from page 0 (`holds(block) -> bool` filters by placement:
        DP/DOP blocks must be on the chosen owner), and whether the next page is a block still being
        computed (the caller then waits rather than compute it again)."""
        got: list[Block] = []
        for k in keys:
            b = self.blocks.get(k)
            if b is None or (holds is not None and not holds(b)):  # type: ignore[operator]
                return got, False
            if not b.ready:
                return got, True
            got.append(b)
        return got, False

    # ---- references -------------------------------------------------------------------------------
    def take(self, blocks: Sequence[Block]) -> None:
        """A table starts with these blocks' columns."""
        for b in blocks:
            if b.refs == 0:
                self._unlist(b)
            b.refs += 1

    def untake(self, blocks: Sequence[Block]) -> None:
        """Undo `take` (a trial: would the request fit with these blocks held?)."""
        for b in blocks:
            b.refs -= 1
            if b.refs == 0:
                self._lru[b.key] = None
                for r, p in enumerate(b.column):
                    self._evictable[r] += p >= 0

    def register(self, key: bytes, index: int, column: Sequence[int]) -> Block | None:
        """A table's page `index` (column `column`) will hold the prefix `key`: a block held by that
        table, not ready. None if another block already has the key (the table's page stays private)
        or a page of the column already belongs to a block."""
        if key in self.blocks or any(p >= 0 and p in self._page[r] for r, p in enumerate(column)):
            return None
        b = Block(key, index, tuple(int(p) for p in column), refs=1)
        self.blocks[key] = b
        for r, p in enumerate(b.column):
            if p >= 0:
                self._page[r][p] = b
        return b

    def block_of(self, rank: int, page: int) -> Block | None:
        """The block (indexed or stale) holding local page `page` of `rank`, or None (a private page)."""
        return self._page[rank].get(page)

    def live_blocks(self) -> list[Block]:
        """Every block that still owns pages: the index's, and stale ones some table still holds."""
        seen: dict[int, Block] = {id(b): b for b in self.blocks.values()}  # (the index's order first)
        for pages in self._page:
            for b in pages.values():
                seen.setdefault(id(b), b)
        return list(seen.values())

    def release_column(self, column: Sequence[int]) -> bool:
        """A table lets go of a column; True if a block held it (its pages are then not the table's to
        free), False if the column's pages are private."""
        for r, p in enumerate(column):
            if p >= 0:
                b = self.block_of(r, p)
                if b is None:
                    return False
                if b.refs <= 0:
                    raise RuntimeError(f"block at page {p} of rank {r} released more often than taken "
                                       f"(prefix-cache bookkeeping bug)")
                b.refs -= 1
                if b.refs == 0:
                    if b.ready and b.indexed:
                        self._lru[b.key] = None
                        for q, x in enumerate(b.column):
                            self._evictable[q] += x >= 0
                    else:
                        # never completed, or stale: the pages go back with the last holder's others
                        self._forget(b)
                        return False
                return True
        return True

    # ---- eviction ---------------------------------------------------------------------------------
    def evictable(self) -> list[int]:
        """Pages per rank that unreferenced blocks hold (free for the taking)."""
        return list(self._evictable)

    def _unlist(self, b: Block) -> None:
        """Take `b` off the LRU if it is there (a stale block may share its key with a new one)."""
        if self.blocks.get(b.key) is b and self._lru.pop(b.key, 0) is None:
            for r, p in enumerate(b.column):
                self._evictable[r] -= p >= 0

    def evict(self, need: Sequence[int]) -> list[list[int]]:
        """Evict LRU blocks until each rank r got `need[r]` pages (or nothing evictable is left there);
        returns the freed local pages per rank (the caller puts them on the free lists)."""
        freed: list[list[int]] = [[] for _ in range(self.world)]
        want = list(need)
        for k in list(self._lru):
            if all(w <= 0 for w in want):
                break
            b = self.blocks[k]
            if not any(want[r] > 0 and p >= 0 for r, p in enumerate(b.column)):
                continue
            self._forget(b)
            for r, p in enumerate(b.column):
                if p >= 0:
                    freed[r].append(p)
                    want[r] -= 1
        return freed

    def flush(self) -> list[list[int]]:
        """Evict every unreferenced block (`/flush_cache`); the freed pages per rank."""
        return self.evict([1 << 62] * self.world)

    def invalidate(self) -> list[list[int]]:
        """Take every block out of the index (weights changed): evictable pages are returned for
        freeing; held blocks turn stale, freed once by their last holder (`release_column`)."""
        freed = self.flush()
        if self.snaps is not None:  # a state computed with the old weights is never read again
            self.snaps.drop(self.live_blocks())
        for b in list(self.blocks.values()):
            b.indexed = False
        self.blocks.clear()
        self.epoch += 1
        return freed

    def moved(self, columns: dict[tuple[int, ...], tuple[int, ...]]) -> None:
        """A layout switch committed: each block's pages now sit at `columns[old column]` (its holders'
        destination pages). Keys, references and readiness survive; a block no live table holds was
        evicted before the switch (`flush`), and stale blocks move with their holders too: a block
        missing from `columns` would lose track of its pages, a bookkeeping bug (raised, nothing changed)."""
        moving = self.live_blocks()
        lost = next((b for b in moving if b.column not in columns), None)
        if lost is not None:
            raise RuntimeError(f"a switch lost the pages {lost.column} of a prefix block held by {lost.refs} "
                               f"table(s) (unreferenced blocks are flushed before a switch; bookkeeping bug)")
        if self.snaps is not None:  # (a block's snapshot keeps its row: the switch moved the row as it
            #                            moved live slots, splash/switch/planner.py `_snapshots`)
            self.snaps.carried += sum(b.snap >= 0 for b in moving)
        for b in moving:
            new = columns[b.column]
            indexed = b.indexed
            self._unindex(b)  # (its snapshot stays its own: the switch moved the row)
            b.column, b.indexed = new, indexed
            if indexed:
                self.blocks[b.key] = b
                if b.refs == 0:
                    self._lru[b.key] = None
                    for r, p in enumerate(new):
                        self._evictable[r] += p >= 0
            for r, p in enumerate(new):
                if p >= 0:
                    self._page[r][p] = b

    def _forget(self, b: Block) -> None:
        """`b` leaves the cache: its snapshot (a hybrid's) is freed with it."""
        if self.snaps is not None and b.snap >= 0:
            self.snaps.release(b)
            self.snaps.evicted += 1
        self._unindex(b)

    def _unindex(self, b: Block) -> None:
        """`b` leaves the LRU, the index and the page map (`moved` lists it again at its new pages)."""
        self._unlist(b)
        if self.blocks.get(b.key) is b:
            del self.blocks[b.key]
        for r, p in enumerate(b.column):
            if p >= 0 and self._page[r].get(p) is b:
                del self._page[r][p]

    # ---- introspection ------------------------------------------------------------------------------
    def shared_blocks(self) -> int:
        """Blocks held by two or more live tables (stale ones included)."""
        return sum(b.refs >= 2 for b in self.live_blocks())

    def stats(self) -> dict[str, object]:
        out = {"prefix_cache_blocks": len(self.blocks), "prefix_cache_evictable_blocks": len(self._lru),
               "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits}
        return out if self.snaps is None else {**out, **self.snaps.stats()}


def moved_columns(pairs: Iterable[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]] | None]]
                  ) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Where a switch puts each page column: old column -> new column at every page index both tables
    of a (before, after) pair hold ([T][pages] each; a missing after or an empty before: skipped). The
    rule a block follows (`PrefixCache.moved`), and its snapshot with it (the switch planner)."""
    cols: dict[tuple[int, ...], tuple[int, ...]] = {}
    for old, new in pairs:
        if new is None or not old:
            continue
        for j in range(min(len(old[0]), len(new[0]))):
            cols[tuple(row[j] for row in old)] = tuple(row[j] for row in new)
    return cols
