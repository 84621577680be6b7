"""Switch manifests (Eq 2, 3, 9): what each rank must receive, free or keep to change layout.

Each layout defines, per rank, the blocks it holds (`splash.core.holdings`, the one statement of the
ownership cases): head slices of every head-sharded projection (weights) and pages of every request's
latent history (KV; CP puts global page j of a request on rank j % T, as the runtime's page tables do).
A switch a -> b is the per-rank set difference: `need = held_b \\ held_a` is received, `free = held_a \\
held_b` is retired. The primitive of a state follows from those sets: nothing received -> discard
(keep, free the rest); received blocks that every destination rank holds -> all-gather; otherwise ->
all-to-all. No direction table is written down anywhere: the 12-direction pattern of the paper falls
out of the ownership model. The records listed are `splash.core.moves`'.

Every MLA layer has the same projection shapes and the same pages (every per-token store of
`splash.core.stores` shares the latent's page ids), so one per-layer plan of blocks serves all layers;
only a page's bytes differ by layer (`AttentionSizes.kv_token_bytes`: a DSA indexer layer adds its
indexer keys, a GLM-5 shared layer has none). `Manifest.layers` lists each layer's manifest for callers
that walk layer by layer (the switch executor, Eq 7); `Manifest.kv` is the largest layer's. Concrete
moves (which heads / pages go from which rank to which) are produced on demand.

A hybrid's KDA layers (SPEC §10) have no pages: their manifest is their head-sliced weights (Eq 9 over
the KDA heads, `Manifest.kda_weights`) and their per-request state (`Manifest.state`): blocks (request,
head) held per rank as `Layout.state_placement` says, moved and freed by the same set differences.
TP <-> DOP keeps it; DP -> TP/DOP scatters each owner's heads to their holders and TP/DOP -> DP gathers
them (all-to-all); into CP it is all-gathered; out of CP it is discarded.

`splash.core.transfer` counts the same holdings without listing them (what the policy prices).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from splash.core.holdings import (
    head_parts,
    held_columns,
    held_head_mask,
    held_state,
    holding,
    page_parts,
    senders,
    state_block_arrays,
)
from splash.core.layouts import DEFAULT_PAGE_SIZE, Layout
from splash.core.model_config import ConfigError, ModelConfig
from splash.core.moves import (
    ALL_GATHER,
    ALL_TO_ALL,
    DISCARD,
    EMPTY_ROWS,
    KEEP,
    BatchItem,
    KVPages,
    LayerManifest,
    PageFree,
    PageMove,
    Request,
    StateBlocks,
    StateFree,
    StateManifest,
    StateMove,
    WeightFree,
    WeightMove,
    as_requests,
    grouped_rows,
    row_runs,
    tokens_per_rank,
)
from splash.core.sizes import MIB, AttentionSizes, head_runs

__all__ = [  # (the records and the holdings, importable from here as before they had modules of their own)
    "ALL_GATHER", "ALL_TO_ALL", "DISCARD", "KEEP", "BatchItem", "KVPages", "LayerManifest", "Manifest",
    "PageFree", "PageMove", "Request", "StateBlocks", "StateFree", "StateManifest", "StateMove",
    "WeightFree", "WeightMove", "as_requests", "held_columns", "held_state", "state_block_arrays",
    "switch_manifest", "weights_report",
]


def _classify(recv_total: float, freed_total: float, keep: bool, gathered: bool) -> str:
    """Nothing received: `keep` when nothing is freed either and `keep` allows it (the same layout;
    always for a KDA state: TP <-> DOP holds the same head slices), else discard."""
    if recv_total == 0:
        return KEEP if keep and freed_total == 0 else DISCARD
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
        r, h = np.nonzero(held_head_mask(self.dst, T, H) & ~held_head_mask(self.src, T, H))  # by receiver
        one = np.zeros(1, dtype=np.int64)  # (the projections: one "request")
        s = senders(holding(self.src.placement, one, T), 0 * h, lambda: head_parts(H, T)[h], r)
        moves: list[WeightMove] = []
        for dst, src in sorted(set(zip(r.tolist(), s.tolist()))):
            for a, b in head_runs(h[(r == dst) & (s == src)].tolist()):
                for p in projections:
                    moves.append(WeightMove(p.name, a, b, src, dst, self.sizes.slice_bytes(p, range(a, b))))
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
        gone = held_head_mask(self.src, T, H) & ~held_head_mask(self.dst, T, H)
        out = []
        for r in range(T):
            for a, b in head_runs(np.flatnonzero(gone[r]).tolist()):
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

    @cached_property
    def _kv_arrays(self) -> tuple[KVPages, np.ndarray, np.ndarray, bool]:
        """(moves and frees as arrays, tokens of each move row, of each free row, whether every moved
        page ends up on every rank). Moves are grouped by (request, receiver, sender), frees by
        (request, rank), pages ascending within a group."""
        T = self.ranks
        req, page, a, b, per_req = self._kv_columns
        need, gone = b & ~a, a & ~b
        moves = move_starts = move_tok = EMPTY_ROWS
        gathered = True
        if need.any():  # (a discard moves nothing: skip the work)
            r, col = np.nonzero(need)  # rank-major, pages ascending within a rank
            i, j = req[col], page[col]
            s = senders(holding(self.src.ownership, per_req[:, 1], T), i, lambda: page_parts(j, T), r)
            moves, move_starts = grouped_rows((i * T + r) * T + s, (i, j, s, r))
            move_tok = self._tokens(moves[:, 0], moves[:, 1])
            gathered = not (need.any(axis=0) & ~b.all(axis=0)).any()
        frees = free_starts = free_tok = EMPTY_ROWS
        if gone.any():
            r, col = np.nonzero(gone)
            i = req[col]
            frees, free_starts = grouped_rows(i * T + r, (i, page[col], r))
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
                for (i, _, s, r), p, t in zip(heads, *row_runs(rows[:, 1], tok, pages.move_starts))]

    def kv_frees(self, layer: int | None = None) -> list[PageFree]:
        pages, _, tok, _ = self._kv_arrays
        rows = pages.frees
        heads = rows[pages.free_starts].tolist()
        per_tok = self._per_token(layer)
        return [PageFree(r, i, tuple(p), t, t * per_tok)
                for (i, _, r), p, t in zip(heads, *row_runs(rows[:, 1], tok, pages.free_starts))]

    @cached_property
    def _kv_tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        """Tokens each rank receives, sends and frees per layer, and the KV primitive."""
        T = self.ranks
        pages, move_tok, free_tok, gathered = self._kv_arrays
        recv = tokens_per_rank(pages.moves[:, 3], move_tok, T)
        send = tokens_per_rank(pages.moves[:, 2], move_tok, T)
        freed = tokens_per_rank(pages.frees[:, 2], free_tok, T)
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
        whether every received block ends up on every rank): `state_block_arrays` of its requests."""
        oa = np.array([r.owner_src for r in self.requests], dtype=np.int64)
        ob = np.array([r.dst_owner for r in self.requests], dtype=np.int64)
        return state_block_arrays(self.src, self.dst, oa, ob, self.ranks, max(self.sizes.kda_heads, 1))

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
        prim = _classify(recv.sum(), freed.sum(), True, gathered)
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
                    batch: Iterable[BatchItem], ranks: int, page_size: int = DEFAULT_PAGE_SIZE,
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
