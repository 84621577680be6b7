"""Switch manifests (Eq 2, 3, 9): what each rank must receive, free or keep to change layout.

Each layout defines, per rank, the blocks it holds: head slices of every head-sharded projection
(weights) and pages of every request's latent history (KV; CP puts global page j of a request on
rank j % T, as the runtime's page tables do). A switch a -> b is the per-rank set difference:
`need = held_b \\ held_a` is received, `free = held_a \\ held_b` is retired. The primitive of a
state follows from those sets: nothing received -> discard (keep, free the rest); received blocks
that every destination rank holds -> all-gather; otherwise -> all-to-all. No direction table is
written down anywhere: the 12-direction pattern of the paper falls out of the ownership model.

Every MLA layer has the same projection shapes and the same pages (every per-token store of
`splash.core.stores` shares the latent's page ids), so one per-layer plan of blocks serves all layers;
only a page's bytes differ by layer (`AttentionSizes.kv_token_bytes`: a DSA indexer layer adds its
indexer keys, a GLM-5 shared layer has none). `Manifest.layers` lists each layer's manifest for callers
that walk layer by layer (the switch executor, Eq 7); `Manifest.kv` is the largest layer's. Concrete
moves (which heads / pages go from which rank to which) are produced on demand.

A hybrid's KDA layers (SPEC §10) have no pages: their manifest is their head-sliced weights (Eq 9 over
the KDA heads, `Manifest.kda_weights`) and their per-request state (`Manifest.state`): blocks (request,
head) held per rank as `Layout.state_placement` says (head-sharded: the rank's slice of every request;
owner: every head on the owner; replicated: everything everywhere), moved and freed by the same set
differences. TP <-> DOP keeps it; DP -> TP/DOP scatters each owner's heads to their holders and
TP/DOP -> DP gathers them (all-to-all); into CP it is all-gathered; out of CP it is discarded.

(Past ~450 lines on purpose: the set differences, their byte totals and the concrete moves are one
derivation from the holdings; split, each half would restate the other's ownership cases.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from splash.core.layouts import Layout, Ownership, StatePlacement
from splash.core.model_config import ConfigError, ModelConfig, head_slice
from splash.core.sizes import MIB, AttentionSizes, head_runs

DISCARD, ALL_GATHER, ALL_TO_ALL, KEEP = "discard", "all-gather", "all-to-all", "keep"


@dataclass(frozen=True)
class Request:
    """One live request: its context length and its owner before and after the switch.

    `first_page`: the request's pages before it are another item's (prefix-cache pages it shares with
    a request listed earlier, SPEC §11): they are counted, moved and freed once, with that item, and
    this item covers global pages first_page .. ceil(context / P) - 1 (positions unchanged, so CP
    still places page j on rank j % T). A shared block needs its sharers on one owner in DP/DOP."""

    context: int
    owner_src: int = 0
    owner_dst: int | None = None
    first_page: int = 0

    @property
    def dst_owner(self) -> int:
        return self.owner_src if self.owner_dst is None else self.owner_dst


BatchItem = Request | int | tuple[int, ...]


def as_requests(batch: Iterable[BatchItem], ranks: int) -> list[Request]:
    """Accept Requests, (context, owner_src[, owner_dst]) tuples, or bare contexts (owner i % T)."""
    out: list[Request] = []
    for i, item in enumerate(batch):
        if isinstance(item, Request):
            r = item
        elif isinstance(item, (int, np.integer)):
            r = Request(int(item), i % ranks, i % ranks)
        else:
            t = tuple(map(int, item))
            r = Request(t[0], t[1] if len(t) > 1 else i % ranks, t[2] if len(t) > 2 else None,
                        t[3] if len(t) > 3 else 0)
        if r.context < 0:
            raise ConfigError(f"request {i}: context must be >= 0, got {r.context}")
        if r.first_page < 0:
            raise ConfigError(f"request {i}: first_page must be >= 0, got {r.first_page}")
        if not (0 <= r.owner_src < ranks and 0 <= r.dst_owner < ranks):
            o = r.dst_owner if 0 <= r.owner_src < ranks else r.owner_src
            raise ConfigError(f"request {i}: owner {o} is not a rank in [0, {ranks})")
        out.append(r)
    return out


# ---- holdings: the blocks a rank holds in a layout ------------------------------------------------
def held_heads(layout: Layout, rank: int, ranks: int, heads: int) -> frozenset[int]:
    """Head ids whose projection slices `rank` holds (every projection is sliced alike)."""
    return frozenset(layout.heads(rank, ranks, heads))


def held_columns(ownership: Ownership, owners: np.ndarray, req: np.ndarray, pages: np.ndarray,
                 ranks: int) -> np.ndarray:
    """[T, k] bool: which rank holds each of k columns (global page `pages[c]` of request `req[c]`, whose
    owner is `owners[req[c]]`), any mix of requests: one numpy pass for a whole batch."""
    rank = np.arange(ranks)[:, None]
    if ownership is Ownership.REPLICATED:
        return np.ones((ranks, len(pages)), dtype=bool)
    if ownership is Ownership.OWNER:
        return rank == owners[req][None, :]
    return rank == (pages % ranks)[None, :]


# ---- concrete moves -------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightMove:
    """`dst` receives heads [start, stop) of projection `proj` from `src` (every layer alike)."""

    proj: str
    start: int
    stop: int
    src: int
    dst: int
    nbytes: float


@dataclass(frozen=True)
class WeightFree:
    rank: int
    proj: str
    start: int
    stop: int
    nbytes: float


@dataclass(frozen=True)
class PageMove:
    """`dst` receives global pages `pages` of request `request` (batch index) from `src`."""

    request: int
    pages: tuple[int, ...]
    src: int
    dst: int
    tokens: int
    nbytes: float  # per layer


@dataclass(frozen=True)
class PageFree:
    rank: int
    request: int
    pages: tuple[int, ...]
    tokens: int
    nbytes: float  # per layer


@dataclass(frozen=True)
class KVPages:
    """One layer's page moves and frees as flat int64 arrays, one row per page, in the order of
    `kv_moves()` / `kv_frees()`; `*_starts` are the rows where each PageMove / PageFree begins.

    A switch moves thousands of pages and the runtime planner checks every one on the switching
    step's critical path: arrays spare it a Python object per page.
    """

    moves: np.ndarray  # [k, 4]: request, global page, sender, receiver
    move_starts: np.ndarray  # [number of PageMoves]
    frees: np.ndarray  # [f, 3]: request, global page, rank
    free_starts: np.ndarray  # [number of PageFrees]

    @classmethod
    def of(cls, moves: Sequence[PageMove], frees: Sequence[PageFree]) -> KVPages:
        """From listed moves and frees (hand-made manifests in tests)."""
        mv = [(m.request, p, m.src, m.dst) for m in moves for p in m.pages]
        fr = [(f.request, p, f.rank) for f in frees for p in f.pages]
        return cls(np.array(mv, dtype=np.int64).reshape(-1, 4), _starts([len(m.pages) for m in moves]),
                   np.array(fr, dtype=np.int64).reshape(-1, 3), _starts([len(f.pages) for f in frees]))


_NONE = np.zeros(0, dtype=np.int64)
_NONE.setflags(write=False)


def _starts(lengths: Sequence[int]) -> np.ndarray:
    return (np.cumsum(lengths, dtype=np.int64) - np.asarray(lengths, dtype=np.int64)).reshape(-1)


def _grouped(keys: np.ndarray, columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `columns` stably sorted by `keys`, and where each run of equal keys starts."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1]))) if k.size else k
    rows = np.empty((len(keys), len(columns)), dtype=np.int64)
    for c, col in enumerate(columns):
        rows[:, c] = col[order]
    return rows, starts


@dataclass(frozen=True)
class StateManifest:
    """One state (weights or KV) of one layer: its primitive and per-rank byte counts."""

    state: str
    primitive: str
    recv_bytes: tuple[float, ...]
    send_bytes: tuple[float, ...]
    freed_bytes: tuple[float, ...]

    @property
    def bytes_per_rank(self) -> float:
        """The busiest rank's received bytes: what bounds the collective's time."""
        return max(self.recv_bytes, default=0.0)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.recv_bytes))

    @property
    def moves_network(self) -> bool:
        return self.total_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "bytes_per_rank": self.bytes_per_rank,
                "bytes_group": self.total_bytes, "recv_bytes": list(self.recv_bytes),
                "freed_bytes": list(self.freed_bytes)}


@dataclass(frozen=True)
class LayerManifest:
    """One layer's manifest: an MLA layer's weights and KV, or a KDA layer's weights and per-request
    state (its `kv` then moves nothing: a KDA layer has no pages)."""

    layer: int
    weights: StateManifest
    kv: StateManifest
    kind: str = "mla"
    state: StateManifest | None = None

    @property
    def recv_bytes(self) -> np.ndarray:
        out = np.asarray(self.weights.recv_bytes) + np.asarray(self.kv.recv_bytes)
        return out if self.state is None else out + np.asarray(self.state.recv_bytes)


@dataclass(frozen=True)
class StateMove:
    """`dst` receives heads [start, stop) of request `request`'s KDA state from `src` (per KDA layer)."""

    request: int
    start: int
    stop: int
    src: int
    dst: int
    nbytes: float


@dataclass(frozen=True)
class StateFree:
    rank: int
    request: int
    start: int
    stop: int
    nbytes: float


@dataclass(frozen=True)
class StateBlocks:
    """One KDA layer's state moves and frees as int64 arrays, one row per (request, head) block:
    moves [k, 4] (request, head, sender, receiver), frees [f, 3] (request, head, rank); rows sorted by
    (request, receiver, sender, head) and (request, rank, head)."""

    moves: np.ndarray
    frees: np.ndarray


def held_state(layout: Layout, owners: np.ndarray, ranks: int, heads: int) -> np.ndarray:
    """[T, B, H] bool: which (request, head) blocks of the per-request state each rank holds in `layout`
    (`stores.state_share` over a whole batch)."""
    B = len(owners)
    kind = layout.state_placement
    if kind is StatePlacement.HEAD_SHARDED:
        mine = np.zeros((ranks, heads), dtype=bool)
        for r in range(ranks):
            mine[r, list(head_slice(heads, r, ranks)) if ranks > 1 else slice(None)] = True
        return np.broadcast_to(mine[:, None, :], (ranks, B, heads)).copy()
    if kind is StatePlacement.OWNER:
        on = np.arange(ranks)[:, None] == np.asarray(owners, dtype=np.int64)[None, :]
        return np.broadcast_to(on[:, :, None], (ranks, B, heads)).copy()
    return np.ones((ranks, B, heads), dtype=bool)


def _state_classify(recv_total: float, freed_total: float, gathered: bool) -> str:
    """A state that nothing enters or leaves is kept in place (TP <-> DOP: the same head slices)."""
    if recv_total == 0:
        return KEEP if freed_total == 0 else DISCARD
    return ALL_GATHER if gathered else ALL_TO_ALL


def _runs(pages: np.ndarray, tok: np.ndarray, starts: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """Pages and token totals of each run of rows (a PageMove or PageFree each)."""
    bounds = np.append(starts, len(pages)).tolist()
    flat = pages.tolist()
    csum = np.concatenate(([0], np.cumsum(tok))).tolist()
    return ([flat[a:b] for a, b in zip(bounds, bounds[1:])],
            [csum[b] - csum[a] for a, b in zip(bounds, bounds[1:])])


def _per_rank(rank: np.ndarray, tokens: np.ndarray, ranks: int) -> np.ndarray:
    """Tokens summed per rank, as float64 (np.bincount of nothing is int64 even with weights)."""
    if not len(rank):
        return np.zeros(ranks)
    return np.bincount(rank, weights=tokens, minlength=ranks).astype(np.float64)


def _classify(recv_total: float, freed_total: float, same_layout: bool, gathered: bool) -> str:
    if recv_total == 0:
        return KEEP if same_layout and freed_total == 0 else DISCARD
    return ALL_GATHER if gathered else ALL_TO_ALL


@dataclass(frozen=True)
class Manifest:
    """A switch src -> dst for one live batch on T ranks; per-layer entries and concrete moves."""

    sizes: AttentionSizes
    src: Layout
    dst: Layout
    ranks: int
    page_size: int
    requests: tuple[Request, ...]
    layer_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.layer_ids:
            object.__setattr__(self, "layer_ids", tuple(range(self.sizes.layers)))

    # -- weights ---------------------------------------------------------------------------------
    def weight_moves(self, kind: str = "mla") -> list[WeightMove]:
        """Per layer: head runs each rank receives, each from the one rank that holds it (`kind`: an
        MLA layer's projections, or "kda": a hybrid's KDA layer's, over the KDA heads).

        When several ranks hold a head (replicated source) the first holder after the receiver,
        cyclically, sends it, which spreads the load. They depend on the layouts and T only, so they
        are kept in `sizes` (a switch planner asks for them at every switch).
        """
        if kind == "kda":
            return list(self.sizes.memo(("kda_weight_moves", self.src, self.dst, self.ranks),
                                        lambda: self._weight_moves(self.sizes.kda_heads,
                                                                   self.sizes.kda_projections)))
        return list(self.sizes.memo(("weight_moves", self.src, self.dst, self.ranks), self._weight_moves))

    def _weight_moves(self, heads: int | None = None,
                      projections: Sequence[Any] | None = None) -> tuple[WeightMove, ...]:
        H = self.sizes.heads if heads is None else heads
        T = self.ranks
        projections = self.sizes.projections if projections is None else projections
        src_sets = [held_heads(self.src, r, T, H) for r in range(T)]
        moves: list[WeightMove] = []
        for r in range(T):
            need = held_heads(self.dst, r, T, H) - src_sets[r]
            by_src: dict[int, list[int]] = {}
            for d in range(1, T):  # each head from its first holder after r, cyclically
                s = (r + d) % T
                if need & src_sets[s]:
                    by_src[s] = sorted(need & src_sets[s])
                    need = need - src_sets[s]
            if need:  # pragma: no cover - every head is held somewhere in any layout
                raise AssertionError(f"head {min(need)} held by no rank")
            for s, hs in sorted(by_src.items()):
                for a, b in head_runs(hs):
                    for p in projections:
                        moves.append(WeightMove(p.name, a, b, s, r, self.sizes.slice_bytes(p, range(a, b))))
        return tuple(moves)

    def weight_frees(self, kind: str = "mla") -> list[WeightFree]:
        if kind == "kda":
            return list(self.sizes.memo(("kda_weight_frees", self.src, self.dst, self.ranks),
                                        lambda: self._weight_frees(self.sizes.kda_heads,
                                                                   self.sizes.kda_projections)))
        return list(self.sizes.memo(("weight_frees", self.src, self.dst, self.ranks), self._weight_frees))

    def _weight_frees(self, heads: int | None = None,
                      projections: Sequence[Any] | None = None) -> tuple[WeightFree, ...]:
        H = self.sizes.heads if heads is None else heads
        T = self.ranks
        projections = self.sizes.projections if projections is None else projections
        out = []
        for r in range(T):
            gone = held_heads(self.src, r, T, H) - held_heads(self.dst, r, T, H)
            for a, b in head_runs(gone):
                for p in projections:
                    out.append(WeightFree(r, p.name, a, b, self.sizes.slice_bytes(p, range(a, b))))
        return tuple(out)

    @cached_property
    def weights(self) -> StateManifest:
        return self.sizes.memo(("weights", self.src, self.dst, self.ranks), self._weights)

    @cached_property
    def kda_weights(self) -> StateManifest:
        """One KDA layer's head-sliced weights (Eq 9 over the KDA heads); nothing for a pure MLA model."""
        return self.sizes.memo(("kda_weights", self.src, self.dst, self.ranks), lambda: self._weights("kda"))

    def _weights(self, kind: str = "mla") -> StateManifest:
        T = self.ranks
        recv, send, freed = np.zeros(T), np.zeros(T), np.zeros(T)
        for m in self.weight_moves(kind):
            recv[m.dst] += m.nbytes
            send[m.src] += m.nbytes
        for f in self.weight_frees(kind):
            freed[f.rank] += f.nbytes
        gathered = not self.dst.sharded
        prim = _classify(recv.sum(), freed.sum(), self.src is self.dst, gathered)
        return StateManifest("weights", prim, tuple(recv), tuple(send), tuple(freed))

    # -- KV ----------------------------------------------------------------------------------------
    @cached_property
    def _kv_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every request's pages side by side: request index and global page per column, which rank
        holds each column before and after ([T, columns] masks), and [B, 3] (context, owner before,
        owner after) per request. One pass of numpy over the whole batch: a switch plan on the critical
        path asks for moves, frees and byte totals."""
        T = self.ranks
        per_req = np.array([(r.context, r.owner_src, r.dst_owner) for r in self.requests],
                           dtype=np.int64).reshape(-1, 3)
        first = np.array([r.first_page for r in self.requests], dtype=np.int64)
        n = np.maximum(-(-per_req[:, 0] // self.page_size) - first, 0)  # pages this item covers
        req = np.repeat(np.arange(len(n)), n)
        page = np.arange(req.size) - np.repeat(np.cumsum(n) - n, n) + first[req]
        return (req, page, held_columns(self.src.ownership, per_req[:, 1], req, page, T),
                held_columns(self.dst.ownership, per_req[:, 2], req, page, T), per_req)

    def _tokens(self, req: np.ndarray, page: np.ndarray) -> np.ndarray:
        """Tokens in each of these pages (the last page of a history may be partial)."""
        P = self.page_size
        return np.minimum(P, self._kv_columns[4][req, 0] - page * P)

    def _senders(self, req: np.ndarray, page: np.ndarray, receiver: np.ndarray) -> np.ndarray:
        """Rank that sends each page to its receiver: the unique holder, or the next one cyclically."""
        own = self.src.ownership
        if own is Ownership.OWNER:
            return self._kv_columns[4][req, 1]
        if own is Ownership.POSITION:
            return page % self.ranks
        return (receiver + 1) % self.ranks  # replicated: never needed

    @cached_property
    def _kv_arrays(self) -> tuple[KVPages, np.ndarray, np.ndarray, bool]:
        """(moves and frees as arrays, tokens of each move row, of each free row, whether every moved
        page ends up on every rank). Moves are grouped by (request, receiver, sender), frees by
        (request, rank), pages ascending within a group."""
        T = self.ranks
        req, page, a, b, _ = self._kv_columns
        need, gone = b & ~a, a & ~b
        moves = move_starts = move_tok = _NONE
        gathered = True
        if need.any():  # (a discard moves nothing: skip the work)
            r, col = np.nonzero(need)  # rank-major, pages ascending within a rank
            i, j = req[col], page[col]
            s = self._senders(i, j, r)
            moves, move_starts = _grouped((i * T + r) * T + s, (i, j, s, r))
            move_tok = self._tokens(moves[:, 0], moves[:, 1])
            gathered = not (need.any(axis=0) & ~b.all(axis=0)).any()
        frees = free_starts = free_tok = _NONE
        if gone.any():
            r, col = np.nonzero(gone)
            i = req[col]
            frees, free_starts = _grouped(i * T + r, (i, page[col], r))
            free_tok = self._tokens(frees[:, 0], frees[:, 1])
        pages = KVPages(moves.reshape(-1, 4), move_starts, frees.reshape(-1, 3), free_starts)
        for a in (pages.moves, pages.move_starts, pages.frees, pages.free_starts, move_tok, free_tok):
            a.setflags(write=False)  # cached on a frozen manifest: kv_moves()/kv are derived from them
        return pages, move_tok, free_tok, gathered

    def kv_pages(self) -> KVPages:
        """`kv_moves()` and `kv_frees()` as flat arrays (one row per page)."""
        return self._kv_arrays[0]

    def _per_token(self, layer: int | None) -> float:
        """KV bytes per token of `layer` (None: the largest layer, `kv_token_layer`)."""
        return self.sizes.kv_token_layer if layer is None else self.sizes.kv_token_bytes(layer)

    def kv_moves(self, layer: int | None = None) -> list[PageMove]:
        """Pages each rank receives, grouped by (request, source, receiver); bytes of `layer` (None: the
        largest layer's; the pages are the same in every layer)."""
        pages, tok, _, _ = self._kv_arrays
        rows = pages.moves
        heads = rows[pages.move_starts].tolist()
        per_tok = self._per_token(layer)
        return [PageMove(i, tuple(p), s, r, t, t * per_tok)
                for (i, _, s, r), p, t in zip(heads, *_runs(rows[:, 1], tok, pages.move_starts))]

    def kv_frees(self, layer: int | None = None) -> list[PageFree]:
        pages, _, tok, _ = self._kv_arrays
        rows = pages.frees
        heads = rows[pages.free_starts].tolist()
        per_tok = self._per_token(layer)
        return [PageFree(r, i, tuple(p), t, t * per_tok)
                for (i, _, r), p, t in zip(heads, *_runs(rows[:, 1], tok, pages.free_starts))]

    @cached_property
    def _kv_tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        """Tokens each rank receives, sends and frees per layer, and the KV primitive."""
        T = self.ranks
        pages, move_tok, free_tok, gathered = self._kv_arrays
        recv = _per_rank(pages.moves[:, 3], move_tok, T)
        send = _per_rank(pages.moves[:, 2], move_tok, T)
        freed = _per_rank(pages.frees[:, 2], free_tok, T)
        return recv, send, freed, _classify(recv.sum(), freed.sum(), self.src is self.dst, gathered)

    def _kv_state(self, per_tok: float) -> StateManifest:
        recv, send, freed, prim = self._kv_tokens
        return StateManifest("kv", prim, tuple(recv * per_tok), tuple(send * per_tok), tuple(freed * per_tok))

    @cached_property
    def kv(self) -> StateManifest:
        """The largest layer's KV (every layer's, but for GLM-5's shared layers: no indexer keys)."""
        return self._kv_state(self.sizes.kv_token_layer)

    def kv_layer(self, layer: int) -> StateManifest:
        """Layer `layer`'s KV: its latent pages plus, in a DSA indexer layer, the same pages' indexer keys."""
        per_tok = self.sizes.kv_token_bytes(layer)
        return self.kv if per_tok == self.sizes.kv_token_layer else self._kv_state(per_tok)

    # -- whole switch ------------------------------------------------------------------------------
    # -- per-request state (a hybrid's KDA layers) -------------------------------------------------
    @property
    def hybrid(self) -> bool:
        return self.sizes.cfg.is_hybrid

    def _layer_kind(self, layer: int) -> str:
        return self.sizes.cfg.layer_kind(layer)

    @cached_property
    def _state_arrays(self) -> tuple[StateBlocks, np.ndarray, np.ndarray, np.ndarray, bool]:
        """(moves and frees of (request, head) blocks, blocks each rank receives / sends / frees, and
        whether every received block ends up on every rank): set differences of `held_state`."""
        T, H = self.ranks, max(self.sizes.kda_heads, 1)
        oa = np.array([r.owner_src for r in self.requests], dtype=np.int64)
        ob = np.array([r.dst_owner for r in self.requests], dtype=np.int64)
        a, b = held_state(self.src, oa, T, H), held_state(self.dst, ob, T, H)
        need, gone = b & ~a, a & ~b
        moves = np.zeros((0, 4), dtype=np.int64)
        send = np.zeros(T)
        if need.any():
            r, i, h = np.nonzero(need)
            s = np.full(len(r), -1, dtype=np.int64)
            for d in range(1, T):  # each block from its first holder after the receiver, cyclically
                cand = (r + d) % T
                pick = (s < 0) & a[cand, i, h]
                s[pick] = cand[pick]
            if (s < 0).any():  # pragma: no cover - every block is held somewhere in any layout
                raise AssertionError("a state block is held by no rank")
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

    def state_blocks(self) -> StateBlocks:
        """One KDA layer's state moves and frees as arrays, one row per (request, head) block (every
        KDA layer alike)."""
        return self._state_arrays[0]

    def state_moves(self) -> list[StateMove]:
        """Head runs of each request's state that each rank receives, grouped by (request, receiver,
        sender); bytes per KDA layer."""
        rows = self.state_blocks().moves
        per = self.sizes.state_head_bytes
        out: list[StateMove] = []
        for i, h, s, r in rows.tolist():
            last = out[-1] if out else None
            if last and (last.request, last.src, last.dst, last.stop) == (i, s, r, h):
                out[-1] = StateMove(i, last.start, h + 1, s, r, last.nbytes + per)
            else:
                out.append(StateMove(i, h, h + 1, s, r, per))
        return out

    def state_frees(self) -> list[StateFree]:
        rows = self.state_blocks().frees
        per = self.sizes.state_head_bytes
        out: list[StateFree] = []
        for i, h, r in rows.tolist():
            last = out[-1] if out else None
            if last and (last.request, last.rank, last.stop) == (i, r, h):
                out[-1] = StateFree(r, i, last.start, h + 1, last.nbytes + per)
            else:
                out.append(StateFree(r, i, h, h + 1, per))
        return out

    @cached_property
    def state(self) -> StateManifest:
        """One KDA layer's per-request state (recurrent + conv): its primitive and per-rank bytes; a
        state that nothing enters or leaves is `keep`. Zero bytes for a pure MLA model."""
        T = self.ranks
        if not self.hybrid:
            z = tuple(0.0 for _ in range(T))
            return StateManifest("state", KEEP, z, z, z)
        _, recv, send, freed, gathered = self._state_arrays
        per = self.sizes.state_head_bytes
        prim = _state_classify(recv.sum(), freed.sum(), gathered)
        return StateManifest("state", prim, tuple(recv * per), tuple(send * per), tuple(freed * per))

    # -- whole switch ------------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[LayerManifest, ...]:
        """Every layer's manifest with its kind: "mla" (weights + KV) or "kda" (weights + state)."""
        w = self.weights
        if not self.hybrid:
            return tuple(LayerManifest(i, w, self.kv_layer(i)) for i in self.layer_ids)
        z = tuple(0.0 for _ in range(self.ranks))
        none = StateManifest("kv", KEEP, z, z, z)
        return tuple(LayerManifest(i, self.kda_weights, none, "kda", self.state)
                     if self._layer_kind(i) == "kda" else LayerManifest(i, w, self.kv_layer(i))
                     for i in self.layer_ids)

    def recv_bytes_per_rank(self) -> np.ndarray:
        """Bytes each rank receives over the whole switch (all layers: weights + KV, and a hybrid's KDA
        weights + state)."""
        per_tok = sum(self.sizes.kv_token_bytes(i) for i in self.layer_ids)
        if not self.hybrid:
            return (np.asarray(self.weights.recv_bytes) * len(self.layer_ids)
                    + np.asarray(self._kv_tokens[0]) * per_tok)
        n_kda = sum(1 for i in self.layer_ids if self._layer_kind(i) == "kda")
        n_mla = len(self.layer_ids) - n_kda
        return (np.asarray(self.weights.recv_bytes) * n_mla + np.asarray(self._kv_tokens[0]) * per_tok
                + (np.asarray(self.kda_weights.recv_bytes) + np.asarray(self.state.recv_bytes)) * n_kda)

    def in_transit_bytes(self) -> np.ndarray:
        """Delta_layer_r of Eq 5: one layer's incoming state per rank (at most one layer in flight: the
        largest; a hybrid's KDA layer brings its weights and state)."""
        mla = np.asarray(self.weights.recv_bytes) + np.asarray(self.kv.recv_bytes)
        if not self.hybrid:
            return mla
        kda = np.asarray(self.kda_weights.recv_bytes) + np.asarray(self.state.recv_bytes)
        kinds = {self._layer_kind(i) for i in self.layer_ids}
        if kinds == {"kda"}:
            return kda
        return np.maximum(mla, kda) if "kda" in kinds else mla

    def to_dict(self) -> dict[str, Any]:
        nl = len(self.layer_ids)
        out = {
            "from": self.src.label, "to": self.dst.label, "layers": nl,
            "weights": self.weights.to_dict(), "kv": self.kv.to_dict(),
            "bytes_per_rank_all_layers": float(self.recv_bytes_per_rank().max(initial=0.0)),
        }
        if self.hybrid:
            out["kda_layers"] = sum(1 for i in self.layer_ids if self._layer_kind(i) == "kda")
            out["kda_weights"] = self.kda_weights.to_dict()
            out["state"] = self.state.to_dict()
        return out


def switch_manifest(model: ModelConfig | AttentionSizes, src: Layout | str, dst: Layout | str,
                    batch: Iterable[BatchItem], ranks: int, page_size: int = 64,
                    dtype: str = "bf16", kv_dtype: str = "bf16", fp8_scales: bool = False,
                    layers: Sequence[int] | None = None) -> Manifest:
    """The manifest of switching `batch` from `src` to `dst` on `ranks` ranks.

    `batch` holds (context_len, owner_src, owner_dst) per request (or Requests, or bare contexts
    with round-robin owners). `layers` restricts the layer ids (default: every layer).
    """
    sizes = model if isinstance(model, AttentionSizes) else AttentionSizes(model, dtype, kv_dtype, fp8_scales)
    sizes.cfg.check_ranks(ranks)
    if page_size < 1:
        raise ConfigError(f"page size must be >= 1, got {page_size}")
    reqs = tuple(as_requests(batch, ranks))
    ids = tuple(range(sizes.layers)) if layers is None else tuple(int(x) for x in layers)
    return Manifest(sizes, Layout.parse(src), Layout.parse(dst), ranks, page_size, reqs, ids)


def weights_report(sizes: AttentionSizes, ranks: int) -> dict[str, Any]:
    """Appendix A: per-layer projection MiB and what a sharded -> replicated switch receives."""
    sizes.cfg.check_ranks(ranks)
    m = switch_manifest(sizes, Layout.TP, Layout.DP, [], ranks)
    per_layer = {k: v / MIB for k, v in sizes.layer_weight_bytes().items()}
    out = {
        "model": sizes.cfg.name, "ranks": ranks, "dtype": sizes.dtype, "fp8_scales": sizes.fp8_scales,
        "per_layer_mib": per_layer,
        "receive_mib_per_rank": m.weights.bytes_per_rank / MIB,
        "receive_mib_group": m.weights.total_bytes / MIB,
        "layers": sizes.layers,
        "receive_mib_per_rank_all_layers": m.weights.bytes_per_rank * sizes.layers / MIB,
        "w_a_gib": sizes.w_a / 2**30,
    }
    if sizes.cfg.is_hybrid:  # MLA rows are its MLA layers'; its KDA layers' weights move alike (Eq 9)
        n_mla, n_kda = len(sizes.mla_layers), len(sizes.kda_layers)
        out.update(mla_layers=n_mla, kda_layers=n_kda,
                   kda_per_layer_mib={k: v / MIB for k, v in sizes.kda_layer_weight_bytes().items()},
                   kda_receive_mib_per_rank=m.kda_weights.bytes_per_rank / MIB,
                   receive_mib_per_rank_all_layers=float(m.recv_bytes_per_rank().max(initial=0.0)) / MIB)
    return out


# ---- closed-form per-rank counts (what the policy evaluates every step) ---------------------------
def _holding_tokens(own: Ownership, s: np.ndarray, owners: np.ndarray, cp: np.ndarray,
                    ranks: int) -> np.ndarray:
    """[T, B] tokens of each request that each rank holds under one ownership."""
    if own is Ownership.REPLICATED:
        return np.broadcast_to(s, (ranks, len(s))).copy()
    if own is Ownership.OWNER:
        return np.where(np.arange(ranks)[:, None] == owners[None, :], s[None, :], 0)
    return cp


def position_tokens_matrix(contexts: np.ndarray, ranks: int, page_size: int | None) -> np.ndarray:
    """[T, B] tokens of each request on each rank when global page j lives on rank j % T."""
    P = 1 if page_size is None else int(page_size)
    full, rem = contexts // P, contexts % P
    r = np.arange(ranks)[:, None]
    tok = (full[None, :] // ranks + (r < (full % ranks)[None, :])) * P
    return tok + np.where(r == (full % ranks)[None, :], rem[None, :], 0)


def kv_transfer_tokens(src: Layout, dst: Layout, contexts: Sequence[int], owners_src: Sequence[int],
                       owners_dst: Sequence[int] | None, ranks: int,
                       page_size: int | None = 64) -> tuple[np.ndarray, np.ndarray]:
    """(received, freed) tokens per rank for one layer's KV, without listing pages.

    Same answer as `Manifest.kv` (the tests check it): a rank receives what the destination
    gives it minus what it already holds, and frees what it held minus what it keeps.
    """
    s = np.asarray(contexts, dtype=np.int64).reshape(-1)
    oa = np.asarray(owners_src, dtype=np.int64).reshape(-1)
    ob = oa if owners_dst is None else np.asarray(owners_dst, dtype=np.int64).reshape(-1)
    cp = position_tokens_matrix(s, ranks, page_size)
    a = _holding_tokens(src.ownership, s, oa, cp, ranks)
    b = _holding_tokens(dst.ownership, s, ob, cp, ranks)
    both = _overlap(src.ownership, dst.ownership, a, b, oa, ob, ranks)
    return (b - both).sum(axis=1), (a - both).sum(axis=1)


def _overlap(oa_kind: Ownership, ob_kind: Ownership, a: np.ndarray, b: np.ndarray,
             oa: np.ndarray, ob: np.ndarray, ranks: int) -> np.ndarray:
    """[T, B] tokens a rank holds in both layouts (set intersection, counted in closed form)."""
    if oa_kind is Ownership.REPLICATED:
        return b
    if ob_kind is Ownership.REPLICATED:
        return a
    if oa_kind is Ownership.OWNER and ob_kind is Ownership.OWNER:
        return np.where(oa[None, :] == ob[None, :], a, 0)
    # owner x position, position x owner, position x position: the position shard on the owner
    return np.minimum(a, b)


def weight_transfer_bytes(sizes: AttentionSizes, src: Layout, dst: Layout, ranks: int) -> np.ndarray:
    """Per-rank bytes of one layer's projections a switch src -> dst receives."""
    recv = sizes.memo(("w_recv", src, dst, ranks),
                      lambda: Manifest(sizes, src, dst, ranks, 1, ()).weights.recv_bytes)
    return np.asarray(recv)


def state_transfer_requests(src: Layout, dst: Layout, owners_src: Sequence[int],
                            owners_dst: Sequence[int] | None, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(received, freed) request states per rank for one KDA layer (a fraction 1/T per head slice),
    without listing blocks: the closed form of `Manifest.state`. Every holding is the rank's head
    slice, all heads or nothing, nested alike on one rank, so the overlap is the smaller share."""
    oa = np.asarray(owners_src, dtype=np.int64).reshape(-1)
    ob = oa if owners_dst is None else np.asarray(owners_dst, dtype=np.int64).reshape(-1)
    a = _state_shares(src, oa, ranks)
    b = _state_shares(dst, ob, ranks)
    both = np.minimum(a, b)
    return (b - both).sum(axis=1), (a - both).sum(axis=1)


def _state_shares(layout: Layout, owners: np.ndarray, ranks: int) -> np.ndarray:
    """[T, B] share of each request's state each rank holds (g)."""
    kind = layout.state_placement
    if kind is StatePlacement.HEAD_SHARDED:
        return np.full((ranks, len(owners)), 1.0 / ranks)
    if kind is StatePlacement.OWNER:
        return (np.arange(ranks)[:, None] == owners[None, :]).astype(np.float64)
    return np.ones((ranks, len(owners)))


def switch_layer_bytes(sizes: AttentionSizes, src: Layout, dst: Layout, contexts: Sequence[int],
                       owners_src: Sequence[int], owners_dst: Sequence[int] | None, ranks: int,
                       page_size: int | None = 64) -> tuple[np.ndarray, np.ndarray]:
    """([layers, T] weight bytes, [layers, T] KV + state bytes) each rank receives per layer in a switch
    src -> dst (closed forms, what the policy and the simulator price by Eq 7): an MLA layer's
    projections and latent pages, a hybrid's KDA layer's projections and per-request states."""
    w_mla = weight_transfer_bytes(sizes, src, dst, ranks)
    kv_tok, _ = kv_transfer_tokens(src, dst, contexts, owners_src, owners_dst, ranks, page_size)
    w = np.tile(w_mla, (sizes.layers, 1))
    kv = np.outer(sizes.kv_layer_bytes, kv_tok)
    if sizes.cfg.is_hybrid:
        w_kda = np.asarray(sizes.memo(("kda_w_recv", src, dst, ranks),
                                      lambda: Manifest(sizes, src, dst, ranks, 1, ()).kda_weights.recv_bytes))
        st, _ = state_transfer_requests(src, dst, owners_src, owners_dst, ranks)
        kda = list(sizes.kda_layers)
        w[kda] = w_kda
        kv[kda] = st * sizes.state_layer_bytes
    return w, kv
