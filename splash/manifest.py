"""Switch manifests (Eq 2, 3, 9): what each rank must receive, free or keep to change layout.

Each layout defines, per rank, the blocks it holds: head slices of every head-sharded projection
(weights) and pages of every request's latent history (KV; CP puts global page j of a request on
rank j % T, as the runtime's page tables do). A switch a -> b is the per-rank set difference:
`need = held_b \\ held_a` is received, `free = held_a \\ held_b` is retired. The primitive of a
state follows from those sets: nothing received -> discard (keep, free the rest); received blocks
that every destination rank holds -> all-gather; otherwise -> all-to-all. No direction table is
written down anywhere: the 12-direction pattern of the paper falls out of the ownership model.

Every MLA layer has the same shapes, so one per-layer plan serves all layers; `Manifest.layers`
lists them for callers that walk layer by layer (the switch executor, Eq 7). Concrete moves
(which heads / pages go from which rank to which) are produced on demand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from splash.config import ConfigError, ModelConfig
from splash.layouts import Layout, Ownership
from splash.sizes import MIB, AttentionSizes, head_runs

DISCARD, ALL_GATHER, ALL_TO_ALL, KEEP = "discard", "all-gather", "all-to-all", "keep"


@dataclass(frozen=True)
class Request:
    """One live request: its context length and its owner before and after the switch."""

    context: int
    owner_src: int = 0
    owner_dst: int | None = None

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
            t = tuple(int(x) for x in item)
            r = Request(t[0], t[1] if len(t) > 1 else i % ranks, t[2] if len(t) > 2 else None)
        if r.context < 0:
            raise ConfigError(f"request {i}: context must be >= 0, got {r.context}")
        for o in (r.owner_src, r.dst_owner):
            if not 0 <= o < ranks:
                raise ConfigError(f"request {i}: owner {o} is not a rank in [0, {ranks})")
        out.append(r)
    return out


# ---- holdings: the blocks a rank holds in a layout ------------------------------------------------
def held_heads(layout: Layout, rank: int, ranks: int, heads: int) -> frozenset[int]:
    """Head ids whose projection slices `rank` holds (every projection is sliced alike)."""
    if not layout.sharded:
        return frozenset(range(heads))
    per = heads // ranks
    return frozenset(range(rank * per, (rank + 1) * per))


def held_pages(ownership: Ownership, owner: int, n_pages: int, ranks: int) -> np.ndarray:
    """[T, n_pages] bool: which rank holds which global page of one request."""
    held = np.zeros((ranks, n_pages), dtype=bool)
    if ownership is Ownership.REPLICATED:
        held[:] = True
    elif ownership is Ownership.OWNER:
        held[owner] = True
    else:
        held[np.arange(n_pages) % ranks, np.arange(n_pages)] = True
    return held


def page_tokens(context: int, page_size: int) -> np.ndarray:
    """Tokens in each global page of a history (the last page may be partial)."""
    n = -(-context // page_size)
    tok = np.full(n, page_size, dtype=np.int64)
    if n:
        tok[-1] = context - (n - 1) * page_size
    return tok


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
    layer: int
    weights: StateManifest
    kv: StateManifest

    @property
    def recv_bytes(self) -> np.ndarray:
        return np.asarray(self.weights.recv_bytes) + np.asarray(self.kv.recv_bytes)


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
    def weight_moves(self) -> list[WeightMove]:
        """Per layer: head runs each rank receives, each from the one rank that holds it.

        When several ranks hold a head (replicated source) the first holder after the receiver,
        cyclically, sends it, which spreads the load.
        """
        H, T = self.sizes.heads, self.ranks
        src_sets = [held_heads(self.src, r, T, H) for r in range(T)]
        moves: list[WeightMove] = []
        for r in range(T):
            need = held_heads(self.dst, r, T, H) - src_sets[r]
            by_src: dict[int, list[int]] = {}
            for h in sorted(need):
                holder = next(((r + d) % T for d in range(1, T) if h in src_sets[(r + d) % T]), None)
                if holder is None:  # pragma: no cover - every head is held somewhere in any layout
                    raise AssertionError(f"head {h} held by no rank")
                by_src.setdefault(holder, []).append(h)
            for s, hs in sorted(by_src.items()):
                for a, b in head_runs(hs):
                    for p in self.sizes.projections:
                        moves.append(WeightMove(p.name, a, b, s, r, self.sizes.slice_bytes(p, range(a, b))))
        return moves

    def weight_frees(self) -> list[WeightFree]:
        H, T = self.sizes.heads, self.ranks
        out = []
        for r in range(T):
            gone = held_heads(self.src, r, T, H) - held_heads(self.dst, r, T, H)
            for a, b in head_runs(gone):
                for p in self.sizes.projections:
                    out.append(WeightFree(r, p.name, a, b, self.sizes.slice_bytes(p, range(a, b))))
        return out

    @cached_property
    def weights(self) -> StateManifest:
        T = self.ranks
        recv, send, freed = np.zeros(T), np.zeros(T), np.zeros(T)
        for m in self.weight_moves():
            recv[m.dst] += m.nbytes
            send[m.src] += m.nbytes
        for f in self.weight_frees():
            freed[f.rank] += f.nbytes
        gathered = not self.dst.sharded
        prim = _classify(recv.sum(), freed.sum(), self.src is self.dst, gathered)
        return StateManifest("weights", prim, tuple(recv), tuple(send), tuple(freed))

    # -- KV ----------------------------------------------------------------------------------------
    @cached_property
    def _kv_holdings(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per request: tokens per page, and which rank holds which page before and after (computed
        once: moves, frees and the byte totals all read them, and a switch plan asks for all three)."""
        out = []
        for req in self.requests:
            tok = page_tokens(req.context, self.page_size)
            out.append((tok, held_pages(self.src.ownership, req.owner_src, len(tok), self.ranks),
                        held_pages(self.dst.ownership, req.dst_owner, len(tok), self.ranks)))
        return out

    def _kv_sets(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._kv_holdings[i]

    def _source_of(self, i: int, page: np.ndarray, receiver: int) -> np.ndarray:
        """Rank that sends page(s) to `receiver`: the unique holder, or the next one cyclically."""
        own = self.src.ownership
        if own is Ownership.OWNER:
            return np.full_like(page, self.requests[i].owner_src)
        if own is Ownership.POSITION:
            return page % self.ranks
        return np.full_like(page, (receiver + 1) % self.ranks)  # replicated: never needed

    def kv_moves(self) -> list[PageMove]:
        """Per layer: pages each rank receives, grouped by (request, source, receiver)."""
        per_tok = self.sizes.kv_token_layer
        moves: list[PageMove] = []
        for i in range(len(self.requests)):
            tok, a, b = self._kv_sets(i)
            need = b & ~a
            for r in np.flatnonzero(need.any(axis=1)):
                pages = np.flatnonzero(need[r])
                srcs = self._source_of(i, pages, int(r))
                for s in np.unique(srcs):
                    sel = pages[srcs == s]
                    t = int(tok[sel].sum())
                    moves.append(PageMove(i, tuple(int(p) for p in sel), int(s), int(r), t, t * per_tok))
        return moves

    def kv_frees(self) -> list[PageFree]:
        per_tok = self.sizes.kv_token_layer
        out: list[PageFree] = []
        for i in range(len(self.requests)):
            tok, a, b = self._kv_sets(i)
            gone = a & ~b
            for r in np.flatnonzero(gone.any(axis=1)):
                sel = np.flatnonzero(gone[r])
                t = int(tok[sel].sum())
                out.append(PageFree(int(r), i, tuple(int(p) for p in sel), t, t * per_tok))
        return out

    @cached_property
    def kv(self) -> StateManifest:
        T, per_tok = self.ranks, self.sizes.kv_token_layer
        recv, send, freed = np.zeros(T), np.zeros(T), np.zeros(T)
        gathered = True
        for i in range(len(self.requests)):
            tok, a, b = self._kv_sets(i)
            need, gone = b & ~a, a & ~b
            recv += need @ tok
            freed += gone @ tok
            moved = need.any(axis=0)
            if moved.any():
                gathered = gathered and bool(b[:, moved].all())
                for r in np.flatnonzero(need.any(axis=1)):
                    pages = np.flatnonzero(need[r])
                    np.add.at(send, self._source_of(i, pages, int(r)), tok[pages])
        recv, send, freed = recv * per_tok, send * per_tok, freed * per_tok
        prim = _classify(recv.sum(), freed.sum(), self.src is self.dst, gathered)
        return StateManifest("kv", prim, tuple(recv), tuple(send), tuple(freed))

    # -- whole switch ------------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[LayerManifest, ...]:
        w, kv = self.weights, self.kv
        return tuple(LayerManifest(i, w, kv) for i in self.layer_ids)

    def recv_bytes_per_rank(self) -> np.ndarray:
        """Bytes each rank receives over the whole switch (all layers, weights + KV)."""
        per_layer = np.asarray(self.weights.recv_bytes) + np.asarray(self.kv.recv_bytes)
        return per_layer * len(self.layer_ids)

    def in_transit_bytes(self) -> np.ndarray:
        """Delta_layer_r of Eq 5: one layer's incoming state per rank (at most one layer in flight)."""
        return np.asarray(self.weights.recv_bytes) + np.asarray(self.kv.recv_bytes)

    def to_dict(self) -> dict[str, Any]:
        nl = len(self.layer_ids)
        return {
            "from": self.src.label, "to": self.dst.label, "layers": nl,
            "weights": self.weights.to_dict(), "kv": self.kv.to_dict(),
            "bytes_per_rank_all_layers": float(self.recv_bytes_per_rank().max(initial=0.0)),
        }


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
    return {
        "model": sizes.cfg.name, "ranks": ranks, "dtype": sizes.dtype, "fp8_scales": sizes.fp8_scales,
        "per_layer_mib": per_layer,
        "receive_mib_per_rank": m.weights.bytes_per_rank / MIB,
        "receive_mib_group": m.weights.total_bytes / MIB,
        "layers": sizes.layers,
        "receive_mib_per_rank_all_layers": m.weights.bytes_per_rank * sizes.layers / MIB,
        "w_a_gib": sizes.w_a / 2**30,
    }


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
