"""The allocator's books, proved: every page of every rank is exactly one of free, held (by as many
tables as hold it), cached-unreferenced or withheld; every state slot is free or held by one request.

`book_errors` checks the allocators, the prefix cache and the state slots of rank 0 against the live
tables it is given (one per sequence that holds pages or a slot) and says what disagrees, in words.
The engine runs it after every step and every control operation when `check_books` is on (the test
suite and `splash bench soak` turn it on), so a bookkeeping error fails the step that makes it, not a
hundred steps later; and once after any failed step, to decide whether the engine can go on.

The rules checked (one place; docs/runtime.md "Events and the books" states them for each event):
- free list: no page twice, each page marked unused; every other page is marked used;
- a page no prefix block owns is held by exactly one table (private);
- a page a block owns is held by exactly `refs` tables; with `refs == 0` the block is in the index,
  ready and on the LRU (cached-unreferenced, counted as free for admission), and no table holds it;
- stale blocks (left by an invalidation) are never on the LRU and always held;
- withheld pages (projection replicas) are in no table, block or free list;
- the four sets cover the rank's pool exactly; the LRU's per-rank page counts match;
- every table has one row per rank, rows of equal length, and its pages sit where the layout places
  them; a block a sequence names sits at that sequence's column of the same page index;
- state slots: held ones distinct, free ones distinct, together every slot once;
- prefix snapshots (KDA hybrids, splash/kv/snapshots.py): the rows after the slots, each free or the
  state of exactly the one indexed block that names it (never a stale one), none leaked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from splash.kv.allocator import KVAllocator


class BooksError(RuntimeError):
    """The allocator's books disagree with the live tables (a bookkeeping bug; the message says where)."""


@dataclass
class Holder:
    """What one live sequence holds: its page table `pages[r][j]`, owner, state slot (-1: none) and the
    prefix blocks it took or registered (None for a private page)."""

    pages: Sequence[Sequence[int]]
    owner: int = 0
    slot: int = -1
    blocks: Sequence[Any] = field(default_factory=list)


def book_errors(alloc: KVAllocator, holders: Mapping[int, Holder], limit: int = 8) -> list[str]:
    """What is wrong with the books of `alloc` given every live holder (empty: they balance)."""
    errs: list[str] = []
    T, cache = alloc.world, alloc.cache
    for hid, h in holders.items():
        if h.pages and (len(h.pages) != T or len({len(row) for row in h.pages}) != 1):
            errs.append(f"seq {hid}: table has {len(h.pages)} rows of lengths "
                        f"{sorted({len(row) for row in h.pages})}, expected {T} of one length")
    if errs:
        return errs[:limit]
    blocks = cache.live_blocks() if cache is not None else []
    for r, a in enumerate(alloc.ranks):
        errs += _rank_errors(r, a, alloc, holders, blocks)
        if len(errs) >= limit:
            return errs[:limit]
    if cache is not None:
        errs += _cache_errors(alloc, holders, blocks)
    errs += _placement_errors(alloc, holders)
    errs += _slot_errors(alloc, holders)
    if cache is not None and cache.snaps is not None:
        snaps = cache.snaps
        if alloc.slots is None or snaps.base != alloc.slots.num_slots:
            errs.append(f"prefix snapshot rows start at {snaps.base}, not after the state slots")
        errs += snaps.errors(blocks)
    return errs[:limit]


def check_books(alloc: KVAllocator, holders: Mapping[int, Holder], where: str = "") -> None:
    """Raise BooksError naming what disagrees (nothing if the books balance)."""
    errs = book_errors(alloc, holders)
    if errs:
        at = f" after {where}" if where else ""
        raise BooksError(f"KV books do not balance{at}: " + "; ".join(errs))


def _rank_errors(r: int, a: Any, alloc: KVAllocator, holders: Mapping[int, Holder],
                 blocks: Sequence[Any]) -> list[str]:
    errs: list[str] = []
    total = len(a._used)
    free = a._free
    free_set = set(free)
    if len(free_set) != len(free):
        dup = [p for p, n in Counter(free).items() if n > 1]
        errs.append(f"rank {r}: pages {dup[:4]} are on the free list twice")
    if a.num_free != len(free):
        errs.append(f"rank {r}: {a.num_free} pages counted free, {len(free)} on the free list")
    bad = [p for p in free_set if not 0 <= p < total or a._used[p]]
    if bad:
        errs.append(f"rank {r}: free pages {sorted(bad)[:4]} are marked used or out of range")
    count: Counter[int] = Counter()
    for h in holders.values():
        if h.pages:
            count.update(p for p in h.pages[r] if p >= 0)
    owned: dict[int, Any] = {}
    for b in blocks:
        p = b.column[r]
        if p >= 0:
            owned[p] = b
    cached = set()
    for p, b in owned.items():
        n = count.get(p, 0)
        if b.refs == 0:
            cached.add(p)
            if n:
                errs.append(f"rank {r}: page {p} is cached-unreferenced but {n} table(s) hold it")
            if not (b.indexed and b.ready):
                errs.append(f"rank {r}: page {p} belongs to an unreferenced block that is "
                            f"{'stale' if not b.indexed else 'not ready'} (should have been freed)")
        elif n != b.refs:
            errs.append(f"rank {r}: page {p} is held by {n} table(s), its block counts {b.refs}")
    private = [p for p, n in count.items() if p not in owned and n != 1]
    if private:
        errs.append(f"rank {r}: pages {sorted(private)[:4]} are held by "
                    f"{[count[p] for p in sorted(private)[:4]]} tables but by no prefix block")
    held, kept = set(count), set(a.withheld)
    if len(kept) != len(a.withheld):
        errs.append(f"rank {r}: a page is withheld twice")
    for name_a, sa, name_b, sb in (("free", free_set, "held", held), ("free", free_set, "cached", cached),
                                   ("free", free_set, "withheld", kept), ("held", held, "withheld", kept),
                                   ("cached", cached, "withheld", kept)):
        both = sa & sb
        if both:
            errs.append(f"rank {r}: pages {sorted(both)[:4]} are both {name_a} and {name_b}")
    out = [p for p in held | cached | kept if not 0 <= p < total]
    if out:
        errs.append(f"rank {r}: pages {sorted(out)[:4]} are outside the pool of {total}")
    used = {p for p in range(total) if a._used[p]}
    if used != held | cached | kept:
        errs.append(f"rank {r}: leaked pages {sorted(used - held - cached - kept)[:4]}, held but free "
                    f"{sorted((held | cached | kept) - used)[:4]}")
    if len(free_set) + len(used) != total:
        errs.append(f"rank {r}: {len(free_set)} free + {len(used)} used != {total} pages")
    if a.num_pages != total - len(a.withheld):
        errs.append(f"rank {r}: num_pages {a.num_pages} != {total} - {len(a.withheld)} withheld")
    return errs


def _cache_errors(alloc: KVAllocator, holders: Mapping[int, Holder], blocks: Sequence[Any]) -> list[str]:
    cache = alloc.cache
    assert cache is not None
    errs: list[str] = []
    for k, b in cache.blocks.items():
        if b.key != k or not b.indexed:
            errs.append(f"prefix index: key {k.hex()[:8]} names a {'stale ' if not b.indexed else ''}block "
                        f"keyed {b.key.hex()[:8]}")
        if not any(p >= 0 and cache.block_of(r, p) is b for r, p in enumerate(b.column)):
            errs.append(f"prefix index: block {k.hex()[:8]} owns no page")
    lru = [cache.blocks.get(k) for k in cache._lru]
    if any(b is None or b.refs != 0 or not b.ready for b in lru):
        errs.append("prefix LRU lists a block that is missing, referenced or not ready")
    want = [0] * alloc.world
    for b in lru:
        if b is not None:
            for r, p in enumerate(b.column):
                want[r] += p >= 0
    if want != cache.evictable():
        errs.append(f"prefix LRU holds {want} pages per rank, its count says {cache.evictable()}")
    unlisted = [b for b in cache.blocks.values() if b.refs == 0 and b.ready and b.key not in cache._lru]
    if unlisted:
        errs.append(f"{len(unlisted)} unreferenced ready block(s) are not on the LRU (never evictable)")
    for b in blocks:
        if b.refs < 0:
            errs.append(f"block at column {b.column} has {b.refs} references")
    for hid, h in holders.items():
        for j, b in enumerate(h.blocks):
            if b is None or not any(p >= 0 and cache.block_of(r, p) is b for r, p in enumerate(b.column)):
                continue  # a private page, or a block since forgotten (it owns no page)
            col = tuple(row[j] for row in h.pages) if h.pages and j < len(h.pages[0]) else None
            if b.index != j or col != b.column:
                errs.append(f"seq {hid}: page {j} is {col}, its block says page {b.index} at {b.column}")
                break
    return errs


def _placement_errors(alloc: KVAllocator, holders: Mapping[int, Holder]) -> list[str]:
    errs: list[str] = []
    lay, T = alloc.core_layout, alloc.world
    for hid, h in holders.items():
        if not h.pages:
            continue
        for j in range(len(h.pages[0])):
            want = set(lay.page_ranks(j, h.owner, T))
            got = {r for r in range(T) if h.pages[r][j] >= 0}
            if want != got:
                errs.append(f"seq {hid} page {j}: held by ranks {sorted(got)}, {alloc.layout} places it on "
                            f"{sorted(want)}")
                break
    return errs


def _slot_errors(alloc: KVAllocator, holders: Mapping[int, Holder]) -> list[str]:
    slots = alloc.slots
    held = [h.slot for h in holders.values() if h.slot >= 0]
    if slots is None:
        return [f"{len(held)} sequence(s) hold state slots on a model without state"] if held else []
    errs: list[str] = []
    dup = [s for s, n in Counter(held).items() if n > 1]
    if dup:
        errs.append(f"state slots {dup[:4]} are held by two sequences")
    free = slots._free
    if len(set(free)) != len(free):
        errs.append("a state slot is on the free list twice")
    both = set(free) & set(held)
    if both:
        errs.append(f"state slots {sorted(both)[:4]} are both free and held")
    used = {s for s in range(slots.num_slots) if slots._used[s]}
    if used != set(held):
        errs.append(f"leaked state slots {sorted(used - set(held))[:4]}, held but free "
                    f"{sorted(set(held) - used)[:4]}")
    if len(set(free)) + len(used) != slots.num_slots:
        errs.append(f"state slots: {len(set(free))} free + {len(used)} used != {slots.num_slots}")
    return errs
