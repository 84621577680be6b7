"""Page allocators for the KV pools of every rank; they live on rank 0 (workers hold only tensors).

A request's KV is a list of *global* pages (global page j holds positions [j*P, (j+1)*P)). Which ranks
store a copy of global page j is the layout's placement rule (`page_ranks`); each holding rank maps it
to one of its own local pages, so a request's page table is `pages[r][j]` (-1 where rank r holds none).
"""

from __future__ import annotations

from collections.abc import Sequence

from splash.core.layouts import Layout
from splash.kv.prefix import PrefixCache, moved_columns
from splash.kv.slots import SlotAllocator


class OutOfPages(RuntimeError):
    """Raised when an allocation is attempted without free pages; callers check `can_grow` first."""


def page_ranks(layout: str, j: int, owner: int, world: int) -> tuple[int, ...]:
    """Ranks that store global page `j` of a request owned by `owner` under `layout` (the core's
    placement rule: TP every rank, DP/DOP the owner, CP rank j % T)."""
    return Layout.named(layout).page_ranks(j, owner, world)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` positions."""
    return -(-tokens // page_size)


def request_capacity(layout: str, pages: list[int], page_size: int, owner: int | None = None) -> int:
    """Largest context one request could hold in `layout` with `pages` free pages per rank to itself:
    under DP/DOP the best owner's pool (or `owner`'s), under TP the smallest rank, under CP the position
    shards."""
    world, lay = len(pages), Layout.named(layout)
    if owner is None:
        owners = range(world) if lay.owned else range(1)
        return max(request_capacity(layout, pages, page_size, o) for o in owners)
    limit = None
    for r, n in enumerate(pages):
        # Pages on rank r per `world` consecutive global pages bound the positions a request reaches.
        share = sum(r in lay.page_ranks(j, owner, world) for j in range(world))
        if share == 0:
            continue
        cap = n * world // share * page_size
        limit = cap if limit is None else min(limit, cap)
    return limit or 0


def balanced_owners(final: Sequence[int], lacks: Sequence[Sequence[int]], avail: Sequence[int],
                    ids: Sequence[int], load: Sequence[int] | None = None
                    ) -> tuple[list[int], int | None, list[int]]:
    """The one owner rule of the owned layouts (DP, DOP): longest projected (`final`) first, each
    request onto the least-loaded rank (by projected size, on top of `load`; ties: most free pages,
    then lowest rank) among those with the free pages it `lacks` there (`avail`: free pages per rank).
    Returns (owners, index of the first request that fits on no rank or None, free pages left then).
    The scheduler admits one request by it, the switch planner places a whole batch by it, and the
    switch controller prices the Policy's batch with it, so none of them disagree."""
    T = len(avail)
    load, avail, owners = [0] * T if load is None else list(load), list(avail), [0] * len(final)
    for i in sorted(range(len(final)), key=lambda i: (-final[i], ids[i])):
        need = lacks[i]
        fits = [r for r in range(T) if need[r] <= avail[r]]
        if not fits:
            return owners, i, avail
        best = min(fits, key=lambda r: (load[r], -avail[r], r))
        owners[i] = best
        load[best] += final[i]
        avail[best] -= need[best]
    return owners, None, avail


class PageAllocator:
    """Free pages of one rank, kept as runs of consecutive pages, handed out best fit.

    Not a LIFO list, so that a request's pages come out in runs: `alloc(n)` takes the first n pages of
    the shortest free run that holds n (the long runs stay for long prompts; a page at a time comes from
    the shortest run, filling holes first), and from the longest runs in turn when no run is that long.
    A prefill/decode transfer moves one piece per run of pages (splash/disagg/transfer.py); a LIFO list
    scattered a decode's reservation over as many pieces as it had pages. Every operation is O(1) in the
    pool's size (O(distinct run lengths) for the best fit)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages  # pages requests may hold (the pool less what is withheld)
        self._used = [False] * num_pages
        self._start: dict[int, int] = {}  # free run: first page -> length
        self._end: dict[int, int] = {}  # free run: one past its last page -> first page
        self._by_len: dict[int, dict[int, None]] = {}  # length -> first pages of the runs that long
        self._num_free = num_pages
        if num_pages:
            self._add(0, num_pages)
        self.withheld: list[int] = []  # pages lent to something other than requests (projection replicas)

    def _add(self, start: int, n: int) -> None:
        self._start[start] = n
        self._end[start + n] = start
        self._by_len.setdefault(n, {})[start] = None

    def _remove(self, start: int) -> int:
        n = self._start.pop(start)
        del self._end[start + n]
        runs = self._by_len[n]
        del runs[start]
        if not runs:
            del self._by_len[n]
        return n

    @property
    def _free(self) -> list[int]:
        """Every free page, highest first (what the books and tests read; O(free pages))."""
        return sorted((p for s, n in self._start.items() for p in range(s, s + n)), reverse=True)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def _take(self, start: int, k: int) -> list[int]:
        """The first k pages of the free run at `start` (the rest stays a run)."""
        n = self._remove(start)
        if n > k:
            self._add(start + k, n - k)
        return list(range(start, start + k))

    def alloc(self, n: int) -> list[int]:
        if n > self._num_free:
            raise OutOfPages(f"asked for {n} pages, {self._num_free} free of {self.num_pages}")
        out: list[int] = []
        while len(out) < n:
            need = n - len(out)
            fits = [k for k in self._by_len if k >= need]
            if fits:
                k = min(fits)
                out += self._take(next(iter(self._by_len[k])), need)
            else:  # (no run is long enough: the longest, then the next)
                k = max(self._by_len)
                out += self._take(next(iter(self._by_len[k])), k)
        for p in out:
            self._used[p] = True
        self._num_free -= n
        return out

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if p < 0:
                continue
            if not self._used[p]:
                raise RuntimeError(f"page {p} freed twice (allocator bookkeeping bug)")
            self._used[p] = False
            self._num_free += 1
            start, n = p, 1
            if p in self._end:  # (a run ends just below p: join it)
                start = self._end[p]
                n += self._remove(start)
            if p + 1 in self._start:  # (a run starts just above p: join it)
                n += self._remove(p + 1)
            self._add(start, n)

    def withhold(self, n: int) -> list[int]:
        """Take `n` pages out of the pool for something else (replica weights live there now): they stay
        marked used but leave `num_pages`, so capacity and `num_used` see a smaller pool."""
        ids = self.alloc(n) if n else []
        self.num_pages -= len(ids)
        self.withheld += ids
        return ids

    def give_back(self) -> None:
        """Undo every `withhold`."""
        ids, self.withheld = self.withheld, []
        self.num_pages += len(ids)
        self.free(ids)


class KVAllocator:
    """The page allocators of all `world` ranks, plus the layout's placement rule.

    Grows and frees whole per-request page tables (`pages[r][j]`), so callers never touch ranks.
    """

    def __init__(self, pages_per_rank: int | Sequence[int], page_size: int, world: int = 1,
                 layout: str | Layout = "tp") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        counts = [pages_per_rank] * world if isinstance(pages_per_rank, int) else list(pages_per_rank)
        if len(counts) != world:
            raise ValueError(f"{len(counts)} page counts given for {world} ranks")
        self.page_size = page_size
        self.world = world
        self.layout = layout  # validates the name
        self.ranks = [PageAllocator(n) for n in counts]
        self.cache: PrefixCache | None = None  # the prefix cache, when on (`enable_prefix_cache`)
        # KDA models: the state slots of the ranks (one index per request, every KDA layer), else None
        self.slots: SlotAllocator | None = None

    def enable_prefix_cache(self) -> PrefixCache:
        """Share full prompt pages by content (splash/kv/prefix.py); unreferenced cached pages count as
        free, and are evicted when the free list runs short."""
        if self.cache is None:
            self.cache = PrefixCache(self.page_size, self.world)
        return self.cache

    @property
    def layout(self) -> str:
        """The running layout's name (a switch's commit sets the destination's)."""
        return self._name

    @layout.setter
    def layout(self, name: str | Layout) -> None:
        self._row = Layout.named(name)
        self._name = self._row.value

    @property
    def core_layout(self) -> Layout:
        """The running layout, as the core defines it (placement, ownership and every rule of them)."""
        return self._row

    # ---- queries --------------------------------------------------------------------------------
    def empty_table(self) -> list[list[int]]:
        return [[] for _ in range(self.world)]

    def demand(self, table: list[list[int]], tokens: int, owner: int) -> list[int]:
        """New local pages each rank must supply for a request to hold `tokens` positions."""
        need = [0] * self.world
        have = len(table[0]) if table else 0
        for j in range(have, pages_for(tokens, self.page_size)):
            for r in self._row.page_ranks(j, owner, self.world):
                need[r] += 1
        return need

    def can_grow(self, table: list[list[int]], tokens: int, owner: int, reserve: int = 0) -> bool:
        """Whether every rank has the free pages (beyond `reserve` each) to reach `tokens` positions
        (unreferenced cached pages count: they are evicted for it)."""
        need = self.demand(table, tokens, owner)
        return all(n == 0 or n + reserve <= f for n, f in zip(need, self.num_free))

    def max_request_tokens(self, owner: int | None = None) -> int:
        """Largest context one request could ever hold if it had the pool to itself (`request_capacity`
        of this layout on every rank's whole pool)."""
        return request_capacity(self.layout, [a.num_pages for a in self.ranks], self.page_size, owner)

    def pool_tokens(self) -> int:
        """Distinct tokens the whole group can hold under this layout (TP: one rank's pool)."""
        return self._row.distinct([a.num_pages * self.page_size for a in self.ranks])

    @property
    def num_free(self) -> list[int]:
        """Pages per rank a request could take now: the free list, plus unreferenced cached pages."""
        if self.cache is None:
            return [a.num_free for a in self.ranks]
        return [a.num_free + e for a, e in zip(self.ranks, self.cache.evictable())]

    @property
    def num_used(self) -> list[int]:
        """Pages per rank held by live tables (cached pages nobody holds count as free)."""
        return [a.num_pages - f for a, f in zip(self.ranks, self.num_free)]

    def take(self, r: int, n: int) -> list[int]:
        """n local pages of rank r, evicting unreferenced cached pages when the free list is short."""
        a = self.ranks[r]
        if n > a.num_free and self.cache is not None:
            got = self.cache.evict([n - a.num_free if q == r else 0 for q in range(self.world)])
            for q, pages in enumerate(got):
                self.ranks[q].free(pages)
        return a.alloc(n)

    def evict_all(self) -> None:
        """Free every unreferenced cached page (`/flush_cache`, a switch's start)."""
        if self.cache is not None:
            for r, pages in enumerate(self.cache.flush()):
                self.ranks[r].free(pages)

    def cache_moved(self, before: dict[int, list[list[int]]], after: dict[int, list[list[int]]]) -> None:
        """A switch committed: requests' tables `before` -> `after` (req id -> [T][pages]); the prefix
        cache's blocks follow their holders' pages."""
        if self.cache is None:
            return
        self.cache.moved(moved_columns((old, after.get(rid)) for rid, old in before.items()))

    def invalidate_cache(self) -> None:
        """Forget the cache (a weight update): nothing cached is matched again."""
        if self.cache is not None:
            for r, pages in enumerate(self.cache.invalidate()):
                self.ranks[r].free(pages)

    @property
    def num_total(self) -> list[int]:
        return [a.num_pages for a in self.ranks]

    # ---- mutations ------------------------------------------------------------------------------
    def grow(self, table: list[list[int]], tokens: int, owner: int) -> None:
        """Extend `table` in place so it covers `tokens` positions; all-or-nothing."""
        if not table:
            table.extend([] for _ in range(self.world))
        if not self.can_grow(table, tokens, owner):
            raise OutOfPages(f"no room to grow a request to {tokens} tokens (free per rank: {self.num_free})")
        new = range(len(table[0]), pages_for(tokens, self.page_size))
        held = [self._row.page_ranks(j, owner, self.world) for j in new]
        for r in range(self.world):  # (each rank's new pages in one take: they come out as a run)
            got = iter(self.take(r, sum(r in h for h in held)))
            table[r].extend(next(got) if r in h else -1 for h in held)

    def shrink(self, table: list[list[int]], tokens: int) -> None:
        """Return the pages of `table` past those `tokens` positions need (a speculative step's rejected
        rows reached into them); a cached block's page only drops its reference, as in `release`."""
        keep = pages_for(tokens, self.page_size)
        if not table or len(table[0]) <= keep:
            return
        tail = [row[keep:] for row in table]
        cache = self.cache
        held = ([cache.release_column([row[j] for row in tail]) for j in range(len(tail[0]))]
                if cache is not None else [False] * len(tail[0]))
        for r, row in enumerate(table):
            self.ranks[r].free([p for p, k in zip(tail[r], held) if not k and p >= 0])
            del row[keep:]

    def release(self, table: list[list[int]]) -> None:
        """Return every page of `table` to its rank (a cached block's: one reference fewer) and empty
        the table."""
        cache = self.cache
        if cache is not None and table and table[0]:
            keep = [cache.release_column([row[j] for row in table]) for j in range(len(table[0]))]
            for r, pages in enumerate(table):
                self.ranks[r].free([p for p, k in zip(pages, keep) if not k])
                pages.clear()
            return
        for r, pages in enumerate(table):
            self.ranks[r].free(pages)
            pages.clear()
