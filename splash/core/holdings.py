"""What each rank holds of each request in a layout: the one statement of the ownership cases.

Both ways of looking at a switch start here: the manifests (`splash.core.manifest`) list the blocks a
rank holds, receives and frees; the closed forms (`splash.core.transfer`) count them without listing
any (what the policy and the simulator price every step). Neither restates the cases.

On rank r a layout holds NONE, PART or ALL of a request's pages (`Ownership`), of its per-request state
(`StatePlacement`), or of the projections (`Placement`, one "request"): replicated -> ALL on every rank;
owner -> ALL on the owner, NONE elsewhere; position / head-sharded / sharded -> PART on every rank. A
block's PART is one rank's: global page j is rank j % T's (as the runtime's page tables place it), a
head is the rank's whose head slice has it (every head rank 0's at T = 1). So the PARTs partition a
request, a rank's PART is the same subset in every layout, and on one rank NONE < PART < ALL are
nested: what a rank holds in both of two layouts is the smaller holding, and the set differences
(received = after - both, freed = before - both) follow from the codes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from splash.core.layouts import Layout, Ownership, Placement, StatePlacement
from splash.core.model_config import head_slice
from splash.core.moves import StateBlocks

NONE, PART, ALL = 0, 1, 2
_WHOLE = (Ownership.REPLICATED, StatePlacement.REPLICATED, Placement.REPLICATED)
_OWNED = (Ownership.OWNER, StatePlacement.OWNER)


def holding(kind: Ownership | StatePlacement | Placement, owners: np.ndarray, ranks: int) -> np.ndarray:
    """[T, B] NONE / PART / ALL: how much of each request (owned by `owners[b]`) each rank holds."""
    if kind in _WHOLE:
        return np.full((ranks, len(owners)), ALL, dtype=np.int8)
    if kind in _OWNED:
        h = np.full((ranks, len(owners)), NONE, dtype=np.int8)
        h[np.asarray(owners, dtype=np.int64), np.arange(len(owners))] = ALL
        return h
    return np.full((ranks, len(owners)), PART, dtype=np.int8)  # by position, head slice


def page_parts(pages: np.ndarray, ranks: int) -> np.ndarray:
    """The rank whose PART each global page is (position ownership: page j on rank j % T)."""
    return pages % ranks


def head_parts(heads: int, ranks: int) -> np.ndarray:
    """The rank whose PART each head is: the rank whose head slice holds it (all rank 0's at T = 1)."""
    part = np.zeros(heads, dtype=np.int64)
    if ranks > 1:
        for r in range(ranks):
            part[list(head_slice(heads, r, ranks))] = r
    return part


def held(codes: np.ndarray, req: np.ndarray, part: Callable[[], np.ndarray]) -> np.ndarray:
    """[T, k] bool: which rank holds each of k blocks (of request `req[c]`, PART of rank `part()[c]`,
    asked only where a PART is held) given the requests' holdings `codes` [T, B]: any mix of requests,
    one numpy pass for a whole batch."""
    T = codes.shape[0]
    whole, split = codes == ALL, codes == PART
    if whole.all():
        return np.ones((T, len(req)), dtype=bool)
    out = np.take(whole, req, axis=1) if whole.any() else None
    if split.any():
        mine = np.arange(T)[:, None] == part()[None, :]
        if not split.all():
            mine &= np.take(split, req, axis=1)
        out = mine if out is None else out | mine
    return np.zeros((T, len(req)), dtype=bool) if out is None else out


def senders(codes: np.ndarray, req: np.ndarray, part: Callable[[], np.ndarray],
            receiver: np.ndarray) -> np.ndarray:
    """The rank that sends each needed block (of request `req[i]`, PART of `part()[i]`, to `receiver[i]`)
    under the source holdings `codes` [T, B]: the first rank after the receiver, cyclically, holding its
    request ALL (spreading the load over replicas), else its PART's rank (a request is held ALL by some
    ranks or split in PARTs, never both)."""
    T = codes.shape[0]
    if not (codes == ALL).any():
        return part()
    after = np.full(codes.shape, -1, dtype=np.int64)  # [r, b]: request b's first ALL holder after r
    for d in range(T - 1, 0, -1):
        cand = (np.arange(T) + d) % T
        after = np.where(codes[cand] == ALL, cand[:, None], after)
    s = after[receiver, req]
    return s if (s >= 0).all() else np.where(s >= 0, s, part())


def held_head_mask(layout: Layout, ranks: int, heads: int) -> np.ndarray:
    """[T, H] bool: the heads whose projection slices each rank holds (every projection alike)."""
    one = np.zeros(heads, dtype=np.int64)  # the projections: one "request", owned by no rank
    return held(holding(layout.placement, one[:1], ranks), one, lambda: head_parts(heads, ranks))


def held_columns(ownership: Ownership, owners: np.ndarray, req: np.ndarray, pages: np.ndarray,
                 ranks: int) -> np.ndarray:
    """[T, k] bool: which rank holds each of k columns (global page `pages[c]` of request `req[c]`, whose
    owner is `owners[req[c]]`)."""
    return held(holding(ownership, owners, ranks), req, lambda: page_parts(pages, ranks))


def held_state(layout: Layout, owners: np.ndarray, ranks: int, heads: int) -> np.ndarray:
    """[T, B, H] bool: which (request, head) blocks of the per-request state each rank holds in `layout`
    (`stores.state_share` over a whole batch)."""
    B = len(owners)
    req = np.repeat(np.arange(B), heads)
    part = lambda: np.tile(head_parts(heads, ranks), B)  # noqa: E731
    return held(holding(layout.state_placement, owners, ranks), req, part).reshape(ranks, B, heads)


def position_tokens_matrix(contexts: np.ndarray, ranks: int, page_size: int | None) -> np.ndarray:
    """[T, B] tokens of each request in each rank's PART of its pages (page j on rank j % T)."""
    P = 1 if page_size is None else int(page_size)
    full, rem = contexts // P, contexts % P
    r = np.arange(ranks)[:, None]
    tok = (full[None, :] // ranks + (r < (full % ranks)[None, :])) * P
    return tok + np.where(r == (full % ranks)[None, :], rem[None, :], 0)


def state_block_arrays(src: Layout, dst: Layout, oa: np.ndarray, ob: np.ndarray, T: int, H: int
                       ) -> tuple[StateBlocks, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Per-request state (a KDA layer's recurrent + conv, per head) from `src` to `dst` for requests
    owned by `oa` before and `ob` after: (moves and frees of (request, head) blocks, blocks each rank
    receives / sends / frees, whether every received block ends up on every rank). Set differences of
    `held_state`; the one rule for live requests' state (`Manifest`) and a hybrid's prefix-cache
    snapshots, which are placed as live state is (splash/kv/snapshots.py). Stated here, beside
    `held_state` and the sender rule it is made of."""
    a, b = held_state(src, oa, T, H), held_state(dst, ob, T, H)
    need, gone = b & ~a, a & ~b
    moves = np.zeros((0, 4), dtype=np.int64)
    send = np.zeros(T)
    if need.any():
        r, i, h = np.nonzero(need)
        s = senders(holding(src.state_placement, oa, T), i, lambda: head_parts(H, T)[h], r)
        order = np.lexsort((h, s, r, i))
        moves = np.stack([i, h, s, r], axis=1)[order].astype(np.int64)
        send = np.bincount(s, minlength=T).astype(np.float64)
    frees = np.zeros((0, 3), dtype=np.int64)
    if gone.any():
        r, i, h = np.nonzero(gone)
        order = np.lexsort((h, r, i))
        frees = np.stack([i, h, r], axis=1)[order].astype(np.int64)
    gathered = not (need.any(axis=0) & ~b.all(axis=0)).any()
    recv = need.sum(axis=(1, 2)).astype(np.float64)
    freed = gone.sum(axis=(1, 2)).astype(np.float64)
    for x in (moves, frees):
        x.setflags(write=False)
    return StateBlocks(moves, frees), recv, send, freed, gathered
