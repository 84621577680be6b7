"""A switch's batch laid out for numpy: every live request's page table side by side (`Columns`),
and the checks a request must pass before the planner lays it out (`request_error`, vectorised as
`first_bad`). Planning is then a few numpy calls over the whole batch instead of dozens per request
(a switch covers thousands of pages of up to hundreds of requests, on the switching step's critical
path)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from splash.kv.allocator import pages_for
from splash.switch.plan import LiveRequest

# Columns of `request_scalars`, and the bounds `request_error` puts on them: _LO[k] <= _HI[k] if valid.
_CONTEXT, _END, _FINAL, _OWNER, _HAVE, _CACHED_PAGES, _END_PAGES, _FINAL_PAGES, _ZERO, _LAST_RANK = range(10)
_LO = [_ZERO, _CONTEXT, _CACHED_PAGES, _HAVE, _ZERO, _OWNER]
_HI = [_CONTEXT, _END, _HAVE, _END_PAGES, _OWNER, _LAST_RANK]


def request_scalars(live: Sequence[LiveRequest], P: int, T: int) -> np.ndarray:
    """[B, 10] int64 per request, the columns named above: tokens, owner, source table length, pages
    (one numpy call: these are per-request numbers, and a numpy call costs more than a division)."""
    rows = [(q.context, q.end, q.final, q.owner, len(q.pages[0]) if q.pages else 0, -(-q.context // P),
             -(-q.end // P), -(-q.final // P), 0, T - 1) for q in live]
    return np.array(rows, dtype=np.int64).reshape(len(rows), 10)


def first_bad(live: Sequence[LiveRequest], scalars: np.ndarray, T: int) -> int:
    """Index of the first request `request_error` rejects (len(live) if none), found for the whole
    batch at once: exactly its checks, vectorised."""
    bad = (scalars[:, _LO] > scalars[:, _HI]).any(axis=1)
    first = int(bad.argmax()) if bad.any() else len(live)
    seen: set[int] = set()
    for i, q in enumerate(live[:first]):  # the checks numpy cannot do: ids seen before, table shape
        if q.req_id in seen or len(q.pages) != T or len(set(map(len, q.pages))) != 1:
            return i
        seen.add(q.req_id)
    return first


def request_error(req: LiveRequest, seen: set[int], T: int, P: int) -> str | None:
    """What is wrong with one request on its own, given the ids before it (None: nothing)."""
    if req.req_id in seen:
        return f"request {req.req_id} listed twice"
    seen.add(req.req_id)
    if len(req.pages) != T or len({len(row) for row in req.pages}) != 1:
        return f"request {req.req_id}: page table must have {T} rows of equal length"
    if not 0 <= req.context <= req.end:
        return f"request {req.req_id}: context {req.context} must be in [0, tokens={req.end}]"
    have = len(req.pages[0])
    if have < pages_for(req.context, P) or have > pages_for(req.end, P):
        return (f"request {req.req_id}: its table has {have} pages; it must cover the "
                f"{req.context} cached tokens and not exceed {req.end} tokens")
    if not 0 <= req.owner < T:
        return f"request {req.req_id}: owner {req.owner} is not a rank in [0, {T})"
    return None


@dataclass
class Columns:
    """A batch's page tables side by side: request i has columns off[i] .. off[i+1] of every [T, pages]
    array, one per page of its destination table (`n[i]` = pages for its `end`). Planning is then a
    few numpy calls over the whole batch instead of dozens per request."""

    context: np.ndarray  # [B] cached tokens
    cached: np.ndarray  # [B] pages holding them
    n: np.ndarray  # [B] pages the destination table covers (for `end` tokens)
    final: np.ndarray  # [B] pages for the projected length (Eq 6)
    off: np.ndarray  # [B + 1] first column of each request
    req: np.ndarray  # [pages] request of each column
    page: np.ndarray  # [pages] global page index of each column within its request
    old: np.ndarray  # [T, pages] source local page ids (-1: not held, or beyond the pages it has now)

    @classmethod
    def of(cls, live: Sequence[LiveRequest], T: int, P: int, scalars: np.ndarray | None = None) -> Columns:
        """`live` must have passed `request_error`; `scalars` is its `request_scalars` if known."""
        scalars = request_scalars(live, P, T) if scalars is None else scalars
        cols = [_CONTEXT, _HAVE, _CACHED_PAGES, _END_PAGES, _FINAL_PAGES]
        context, have, cached, n, final = scalars[:, cols].T
        off = np.zeros(len(live) + 1, dtype=np.int64)
        np.cumsum(n, out=off[1:])
        req = np.repeat(np.arange(len(live)), n)
        page = np.arange(req.size) - off[req]
        old = np.full((T, req.size), -1, dtype=np.int64)
        # where each request's source pages go: all its columns, unless a table is shorter than `end`
        held = int(have.sum())
        at = slice(None) if held == req.size else (  # (have <= n request by request)
            np.arange(held) + np.repeat(off[:-1] - (np.cumsum(have) - have), have))
        for r in range(T):
            old[r, at] = np.fromiter(itertools.chain.from_iterable(q.pages[r] for q in live),
                                     dtype=np.int64, count=held)
        return cls(context, cached, n, final, off, req, page, old)

    @cached_property
    def mine(self) -> np.ndarray:
        """[T, pages] whether a rank holds a column's page now."""
        return self.old >= 0

    @cached_property
    def is_cached(self) -> np.ndarray:
        """[pages] whether a column holds cached history (the pages the manifest knows about)."""
        return self.page < self.cached[self.req]

    @cached_property
    def rep(self) -> np.ndarray:
        """[pages] index of the column that stands for each column's page: itself, or (a prefix-cache
        page several tables share) the first column holding the same local pages. A shared page is
        counted, moved and freed once, through its first column; the others alias it."""
        T, N = self.old.shape
        if not N:
            return np.zeros(0, dtype=np.int64)
        held = self.mine.any(axis=0)
        first = self.mine.argmax(axis=0)  # the first rank holding each column names its page
        page = first * (int(self.old.max()) + 1) + self.old[first, np.arange(N)]
        key = np.where(held, page, -1 - np.arange(N))
        _, inv = np.unique(key, return_inverse=True)
        firsts = np.full(int(inv.max()) + 1, N, dtype=np.int64)
        np.minimum.at(firsts, inv, np.arange(N))
        return firsts[inv]

    @cached_property
    def alias(self) -> np.ndarray:
        """[pages] whether a column aliases an earlier one (a shared page counted elsewhere)."""
        return self.rep != np.arange(self.rep.size)

    @cached_property
    def first_own(self) -> np.ndarray:
        """[B] pages at the start of each request that alias earlier requests' (its shared prefix).
        Prefix sharing makes them a prefix of the table; `shared_error` checks that."""
        counts = np.concatenate([[0], np.cumsum(self.alias, dtype=np.int64)])
        return counts[self.off[1:]] - counts[self.off[:-1]]

    def shared_error(self) -> str | None:
        """Why the tables' shared pages cannot be switched (None: they can): an aliased page must sit at
        the same page index as the page it aliases, and a request's aliased pages must be a prefix."""
        if not self.alias.any():
            return None
        c = np.nonzero(self.alias)[0]
        bad = self.page[c] != self.page[self.rep[c]]
        k = self.first_own[self.req[c]]
        bad |= self.page[c] >= k
        if bad.any():
            i = int(c[int(bad.argmax())])
            return (f"request index {int(self.req[i])}: page {int(self.page[i])} is shared with page "
                    f"{int(self.page[self.rep[i]])} of another request, out of prefix order")
        return None

    def first_orphan(self) -> tuple[int, int] | None:
        """(request, page) of the first cached page no rank holds."""
        orphan = ~self.mine.any(axis=0)
        if orphan.any():  # (a column no rank holds is rare: a table shorter than `end`, or a corrupt one)
            orphan &= self.is_cached
        if not orphan.any():
            return None
        c = int(orphan.argmax())
        return int(self.req[c]), int(self.page[c])

    def held_per_request(self) -> np.ndarray:
        """[T, B] source pages each rank holds of each request (a shared page: by its first holder)."""
        held = np.zeros((self.old.shape[0], self.old.shape[1] + 1), dtype=np.int64)
        np.cumsum(self.mine & ~self.alias, axis=1, out=held[:, 1:])
        return held[:, self.off[1:]] - held[:, self.off[:-1]]
