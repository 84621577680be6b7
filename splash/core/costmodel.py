"""Per-step cost model (Eq 10), exposed switch time (Eq 7) and the calibration vector theta.

Eq 10 per MLA layer and rank: t_proj = max(F_proj/Phi_proj, W/beta_W), t_att = max(F_att/Phi_att,
K_read/beta_KV), and t = t0 + t_proj + t_att + delta + max(0, R - eta*t_att). The loads F, W, K_read
and R come from the ownership model for the *live* batch (unbalanced contexts and owners welcome),
so the same function prices TP, DP, CP and DOP; theta holds only rates, latencies and budgets.
The illustrative law of Eq 11/12 lives in `splash/core/law.py`.

Sparse attention (DSA, SPEC §9): a query's main attention reads at most `index_topk` keys whatever the
context, while each indexer layer scores every visible key (H_I * d_I MACs and d_I values per key) and
runs its own projections on the rows (replicated in every layout: rows are placed as the KV is, all of
them in TP and CP, each owner's under DP and DOP). The indexer is a second roofline inside t_att. GLM-5's
shared layers reuse the previous indexer's selection: sparse main attention, no indexer. Layers of one
kind cost alike, so a step is the sum over the kinds (`layer_kinds`) of count x one layer's cost.

A hybrid's KDA layers (SPEC §10) are one more kind (`kda_layer_loads`), constant per token: their
projections (t_proj) and the state update (t_att: ~8 d^2 FLOPs per row and head, and one read + write
of the state per request with rows), no context-dependent term. The share a rank computes follows the
state placement: TP/DOP each rank its heads of every row (one all-reduce after o), DP the owner's rows
(one all-gather), CP every row whole on every rank (redundant, no collective).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from splash.core.config import ConfigError
from splash.core.layouts import LAYOUTS, Layout, Ownership, StatePlacement, round_robin_owners
from splash.core.manifest import position_tokens_matrix
from splash.core.sizes import AttentionSizes

# Collectives per attention layer (each pays the latency delta once): TP all-reduce after O;
# DP all-gather of owners' rows; CP exact LSE merge; DOP forward + reverse all-to-all + all-reduce.
COLLECTIVES = {Layout.TP: 1, Layout.DP: 1, Layout.CP: 1, Layout.DOP: 3}
DEFAULT_ETA = {"TP": 0.0, "DP": 0.0, "CP": 0.5, "DOP": 0.5}


@dataclass
class Theta:
    """Deployment parameters of pi(x; theta): rates, latencies and the memory budget per rank."""

    ranks: int
    memory_bytes: float  # H_r: device memory usable per rank
    flops_proj: float  # Phi_proj, FLOP/s for the projections
    flops_att: float  # Phi_att, FLOP/s for attention
    bw_weights: float  # beta_W, bytes/s reading projection weights
    bw_kv: float  # beta_KV, bytes/s reading latent KV
    link_bw: float  # bytes/s one rank receives in a collective
    latency: float  # delta: seconds per collective
    t0: float = 0.0  # seconds per step outside the attention stages
    t_row: float = 0.0  # seconds per query row outside attention (dense / MoE), layout-independent
    t_experts: float = 0.0  # seconds to stream all of a rank's expert weights once
    expert_frac: float = 0.0  # share of experts one token routes to (top-k / E): N rows touch
    #                           1 - (1 - expert_frac)^N of them, so small batches read few experts
    eta: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_ETA))
    reserve_bytes: float = 0.0  # R_r: transient reserve kept free
    act_bytes: float = 2.0  # bytes per activation element exchanged
    name: str = ""
    source: str = "profile"
    t_seq: float = 0.0  # seconds per request a rank attends, per layer (per-slice launch/gather cost;
    #                     0 in the paper's profiles, measured by `splash calibrate` on this runtime)
    collectives: dict[str, float] | None = None  # collectives per attention layer, per layout
    #                     (None: COLLECTIVES; calibration fits them as effective counts in `latency` units,
    #                     since an all-to-all and an all-reduce do not cost one latency alike)
    t_req: float = 0.0  # seconds per request with rows this step, outside attention and layout-independent
    #                     (per-request step work: positions, page tables, sampling; 0 in the paper's
    #                     profiles, measured by `splash calibrate` on this runtime)
    link_bw_by_layout: dict[str, float] | None = None  # bytes/s of each layout's collectives (None:
    #                     link_bw for all; calibration fits one per layout: all-reduce, all-gather and
    #                     all-to-all move their bytes at different rates)

    def __post_init__(self) -> None:
        if int(self.ranks) < 1:
            raise ConfigError(f"theta: ranks must be >= 1, got {self.ranks}")
        self.ranks = int(self.ranks)
        for f in ("memory_bytes", "flops_proj", "flops_att", "bw_weights", "bw_kv", "link_bw"):
            if not float(getattr(self, f)) > 0:
                raise ConfigError(f"theta: {f} must be > 0, got {getattr(self, f)}")
        if not 0 <= float(self.expert_frac) <= 1:
            raise ConfigError(f"theta: expert_frac must be in [0, 1], got {self.expert_frac}")
        for f in ("latency", "t0", "t_row", "t_experts", "reserve_bytes", "t_req"):
            if float(getattr(self, f)) < 0:
                raise ConfigError(f"theta: {f} must be >= 0, got {getattr(self, f)}")
        eta = {Layout.parse(k).label: float(v) for k, v in dict(self.eta).items()}
        for k, v in eta.items():
            if not 0 <= v <= 1:
                raise ConfigError(f"theta: eta[{k}] must be in [0, 1], got {v}")
        self.eta = {lay.label: eta.get(lay.label, DEFAULT_ETA[lay.label]) for lay in LAYOUTS}
        if float(self.t_seq) < 0:
            raise ConfigError(f"theta: t_seq must be >= 0, got {self.t_seq}")
        if self.collectives is not None:
            coll = {Layout.parse(k).label: float(v) for k, v in dict(self.collectives).items()}
            if any(v < 0 for v in coll.values()):
                raise ConfigError(f"theta: collectives must be >= 0, got {coll}")
            self.collectives = {lay.label: coll.get(lay.label, float(COLLECTIVES[lay])) for lay in LAYOUTS}
        if self.link_bw_by_layout is not None:
            bw = {Layout.parse(k).label: float(v) for k, v in dict(self.link_bw_by_layout).items()}
            if not all(v > 0 for v in bw.values()):
                raise ConfigError(f"theta: link_bw_by_layout must be > 0, got {bw}")
            self.link_bw_by_layout = {lay.label: bw.get(lay.label, float(self.link_bw)) for lay in LAYOUTS}

    def eta_of(self, layout: Layout) -> float:
        return self.eta[layout.label]

    def collectives_of(self, layout: Layout) -> float:
        """Collectives one attention layer of `layout` issues (each pays the latency delta once)."""
        return COLLECTIVES[layout] if self.collectives is None else self.collectives[layout.label]

    def link_bw_of(self, layout: Layout) -> float:
        """Bytes/s the collectives of `layout` move (link_bw unless calibrated per layout)."""
        return self.link_bw if self.link_bw_by_layout is None else self.link_bw_by_layout[layout.label]

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Theta:
        if not isinstance(d, dict):
            raise ConfigError("theta JSON must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"theta JSON has unknown field(s): {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"theta JSON is incomplete: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Theta:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no theta file at {path!r}; write one with `splash calibrate --out FILE` "
                              "(plan and simulate can use a built-in profile instead: --gpu)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not a theta JSON file: {e}") from None
        return cls.from_dict(d)


@dataclass(frozen=True)
class Batch:
    """The policy's input x: live contexts s_i (including this step's rows), query rows q_i, owners."""

    contexts: np.ndarray
    rows: np.ndarray
    owners: np.ndarray
    reserved: np.ndarray | None = None  # KV tokens held per request (>= context) for the memory checks

    @property
    def kv_tokens(self) -> np.ndarray:
        """Tokens of KV each request occupies: its reservation if the scheduler reserves ahead."""
        return self.contexts if self.reserved is None else self.reserved

    @classmethod
    def make(cls, contexts: Sequence[int], rows: Sequence[int] | int | None = None,
             owners: Sequence[int] | None = None, ranks: int = 1,
             reserved: Sequence[int] | None = None) -> Batch:
        s = np.asarray(contexts, dtype=np.int64).reshape(-1)
        if rows is None or np.isscalar(rows):
            q = np.full(len(s), 1 if rows is None else int(rows), dtype=np.int64)
        else:
            q = np.asarray(rows, dtype=np.int64).reshape(-1)
        o = np.asarray(round_robin_owners(len(s), ranks) if owners is None else owners,
                       dtype=np.int64).reshape(-1)
        if not (len(q) == len(s) == len(o)):
            raise ConfigError(f"batch: {len(s)} contexts, {len(q)} row counts, {len(o)} owners")
        if (s < 0).any() or (q < 0).any() or (q > np.maximum(s, 0)).any():
            raise ConfigError("batch: need 0 <= q_i <= s_i (s_i counts this step's rows)")
        if len(o) and (o.min() < 0 or o.max() >= ranks):
            raise ConfigError(f"batch: owners must lie in [0, {ranks})")
        res = None if reserved is None else np.asarray(reserved, dtype=np.int64).reshape(-1)
        if res is not None and (res.shape != s.shape or (res < s).any()):
            raise ConfigError("batch: reserved KV must be given per request and be >= its context")
        return cls(s, q, o, res)

    @classmethod
    def balanced(cls, batch: int, context: int, rows: int = 1, ranks: int = 1) -> Batch:
        return cls.make([context] * batch, rows, None, ranks)

    @property
    def size(self) -> int:
        return len(self.contexts)

    @property
    def n_rows(self) -> int:
        return int(self.rows.sum())


@dataclass(frozen=True)
class StepCost:
    """Eq 10 for one layout on one batch: the step time and its stages (per layer, busiest rank; the
    mean over the layers where their kinds differ, so `layers * per_layer` is the attention's time)."""

    layout: Layout
    total: float
    t_proj: float
    t_att: float
    comm: float
    delta: float
    exposed_comm: float
    layers: int
    t_index: float = 0.0  # the DSA indexer's part of t_att (its scoring roofline)

    @property
    def per_layer(self) -> float:
        return self.t_proj + self.t_att + self.delta + self.exposed_comm

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.label, "step_s": self.total, "t_proj_s": self.t_proj,
                "t_att_s": self.t_att, "t_index_s": self.t_index, "comm_s": self.comm, "delta_s": self.delta,
                "exposed_comm_s": self.exposed_comm}


def _proj_flops_per_row_head(sizes: AttentionSizes) -> float:
    """Absorbed MLA per query row and head: q_b, W_UK, W_UV and O matmuls (2 FLOPs per MAC)."""
    c = sizes.cfg
    q_in = c.q_lora_rank or c.hidden_size
    return 2.0 * (q_in * c.qk_head_dim + c.qk_nope_head_dim * c.kv_lora_rank
                  + c.kv_lora_rank * c.v_head_dim + c.v_head_dim * c.hidden_size)


def _att_flops_per_key_head(sizes: AttentionSizes) -> float:
    """Scores over d_c + d_r plus value accumulation over d_c, per (row, key, head)."""
    c = sizes.cfg
    return 2.0 * (c.latent_dim + c.kv_lora_rank)


def _index_flops_per_key(sizes: AttentionSizes) -> float:
    """The indexer's score of one (row, key): H_I heads of d_I MACs (2 FLOPs per MAC)."""
    c = sizes.cfg
    return 2.0 * c.index_n_heads * c.index_head_dim


def _index_proj_flops_per_row(sizes: AttentionSizes) -> float:
    """The indexer's projections per row: wq_b (q_lora -> H_I*d_I), wk (d -> d_I), weights_proj (d -> H_I)."""
    c = sizes.cfg
    q_in = c.q_lora_rank or c.hidden_size
    hi, di = c.index_n_heads, c.index_head_dim
    return 2.0 * (q_in * hi * di + c.hidden_size * (di + hi))


def layer_kinds(sizes: AttentionSizes) -> tuple[tuple[int, bool], ...]:
    """(layers, runs an indexer) per kind of attention layer that costs alike: a dense model's L layers;
    a DSA model's indexer layers and, in GLM-5, its shared layers (sparse attention, no indexer); a
    hybrid's MLA layers (its KDA layers are priced by `kda_layer_loads`)."""
    c = sizes.cfg
    if not c.is_sparse:
        return ((len(c.mla_layers) if c.is_hybrid else sizes.layers, False),)
    full = sizes.memo("indexer_layers", lambda: len(c.indexer_layers))
    return tuple((n, ix) for n, ix in ((full, True), (sizes.layers - full, False)) if n)


def attended_keys(contexts: np.ndarray, rows: np.ndarray, topk: int | None) -> np.ndarray:
    """Mean keys one of a request's rows attends: its last q of s positions see s-q+1 .. s keys
    causally, each capped at `topk` (DSA's selection; None: dense, the mean is s - (q-1)/2)."""
    s, q = np.asarray(contexts, dtype=float), np.asarray(rows, dtype=float)
    dense = np.maximum(s - (q - 1) / 2, 0)
    if topk is None:
        return dense
    first = s - q + 1  # keys the first row sees
    under = np.clip(topk - first + 1, 0, q)  # rows that see at most topk keys
    total = under * first + under * (under - 1) / 2 + (q - under) * topk
    return np.divide(total, q, out=np.zeros_like(total), where=q > 0)


@dataclass(frozen=True)
class LayerLoads:
    """Per-rank loads of one MLA layer of `layout` on a batch (Eq 10's F, W, K_read, R), no rates."""

    f_proj: np.ndarray  # FLOPs of the projections per rank (the indexer's included)
    w_read: np.ndarray  # projection weight bytes read per rank (0 on a rank without rows)
    f_att: np.ndarray  # main attention FLOPs per rank
    kv_read: np.ndarray  # latent KV bytes read per rank
    slices: np.ndarray  # requests with rows this step that each rank attends
    comm_bytes: float  # R in bytes one rank receives (busiest rank)
    collectives: float  # collectives per layer (0 on one rank)
    f_index: np.ndarray | None = None  # the DSA indexer's scoring FLOPs per rank (None: no indexer)
    index_read: np.ndarray | None = None  # indexer key bytes it reads per rank


def _spread(layout: Layout, o: np.ndarray, per_req: np.ndarray, share: np.ndarray | None,
            T: int) -> np.ndarray:
    """A per-request quantity summed on the ranks that hold the request's KV: its owner, each rank by
    its position share (CP), or every rank whole (TP)."""
    if layout.ownership is Ownership.OWNER:
        return np.bincount(o, weights=per_req, minlength=T)
    if layout.ownership is Ownership.POSITION:
        return share @ per_req
    return np.full(T, per_req.sum())


def layer_loads(layout: Layout, sizes: AttentionSizes, batch: Batch, ranks: int, act_bytes: float,
                collectives: float, page_size: int | None = None, indexer: bool | None = None) -> LayerLoads:
    """The rate-free quantities of Eq 10, from the ownership model of the live batch.

    `indexer`: whether this layer runs a DSA indexer (None: whether the model has one; see
    `layer_kinds`). A DSA model's main attention is sparse in every layer."""
    T, H, c = ranks, sizes.heads, sizes.cfg
    q, o = batch.rows.astype(float), batch.owners
    s = np.where(q > 0, batch.contexts, 0).astype(float)  # requests without rows read no KV this step
    active = (q > 0).astype(float)
    heads = H / T if layout.sharded else H  # projection heads per rank
    att_heads = H / T if layout is Layout.TP else H  # DOP's owner attends its rows over all heads
    keys = attended_keys(s, q, c.index_topk)  # mean keys a causal row attends (at most top-k in DSA)
    read = s if c.index_topk is None else np.minimum(s, q * c.index_topk)  # latent keys read per request
    share = None
    if layout.ownership is Ownership.POSITION:
        share = position_tokens_matrix(s.astype(np.int64), T, page_size) / np.maximum(s, 1)[None, :]
    if layout.ownership is Ownership.OWNER:
        rows_r = np.bincount(o, weights=q, minlength=T)
        slices_r = np.bincount(o, weights=active, minlength=T)
    else:
        rows_r = np.full(T, q.sum())
        slices_r = np.full(T, active.sum())  # CP: every rank visits every slice (its keys may be few)
    w_rank = sizes.w_layer / T if layout.sharded else sizes.w_layer
    f_proj = rows_r * heads * _proj_flops_per_row_head(sizes)
    w_read = np.where(rows_r > 0, w_rank, 0.0)
    f_index = index_read = None
    if c.is_sparse if indexer is None else indexer:
        # Replicated projections on the rows this rank's KV serves (all in TP/CP, its own in DP/DOP);
        # scoring every visible key it holds.
        idx_rows = np.bincount(o, weights=q, minlength=T) if layout.owned else np.full(T, q.sum())
        f_proj = f_proj + idx_rows * _index_proj_flops_per_row(sizes)
        w_read = w_read + np.where(idx_rows > 0, sizes.indexer_layer_bytes, 0.0)
        scored = q * attended_keys(s, q, None)
        f_index = _spread(layout, o, scored, share, T) * _index_flops_per_key(sizes)
        index_read = _spread(layout, o, s, share, T) * sizes.store_bytes("index_k")
    return LayerLoads(
        f_proj=f_proj,
        w_read=w_read,
        f_att=_spread(layout, o, q * keys, share, T) * att_heads * _att_flops_per_key_head(sizes),
        kv_read=_spread(layout, o, read, share, T) * sizes.store_bytes("latent"),
        slices=slices_r,
        comm_bytes=_comm_bytes(layout, sizes, batch, T, act_bytes, rows_r),
        collectives=float(collectives) if T > 1 else 0.0,
        f_index=f_index,
        index_read=index_read,
    )


KDA_STATE_FLOPS_PER_D2 = 8.0  # per row and head: decay S*exp(g), k^T S, the rank-1 update, q^T S (d^2 each)


def _kda_proj_flops_per_row_head(sizes: AttentionSizes) -> float:
    """A KDA layer's head-sliced matmuls per row and head: q, k, v, their convs, f_b, g_b, b and o."""
    c = sizes.cfg
    d, hid, K = c.linear_head_dim, c.hidden_size, c.linear_conv_kernel
    return 2.0 * (3 * hid * d + 3 * d * K + 2 * d * d + hid + d * hid)


def _kda_replicated_flops_per_row(sizes: AttentionSizes) -> float:
    """A KDA layer's low-rank gate projections per row (f_a, g_a: hidden -> d), replicated."""
    c = sizes.cfg
    return 2.0 * 2 * c.hidden_size * c.linear_head_dim


def kda_layer_loads(layout: Layout, sizes: AttentionSizes, batch: Batch, ranks: int,
                    act_bytes: float) -> LayerLoads:
    """The rate-free loads of one KDA layer (constant in context): rows and heads each rank computes as
    the state placement says, its projections and state update, one read + write of its state share
    per request with rows, and the layer's collective (none in CP, whose ranks compute everything)."""
    T, c = ranks, sizes.cfg
    H, d = c.linear_num_heads, c.linear_head_dim
    q, o = batch.rows.astype(float), batch.owners
    active = (q > 0).astype(float)
    kind = layout.state_placement
    if kind is StatePlacement.OWNER:
        rows_r = np.bincount(o, weights=q, minlength=T)
        req_r = np.bincount(o, weights=active, minlength=T)
    else:
        rows_r, req_r = np.full(T, q.sum()), np.full(T, active.sum())
    heads = H / T if kind is StatePlacement.HEAD_SHARDED else H
    w_rank = sizes.w_layer_kda / T if layout.sharded else sizes.w_layer_kda
    w_rank += sizes.kda_replicated_layer_bytes
    N, hid = batch.n_rows, c.hidden_size
    if T == 1 or kind is StatePlacement.REPLICATED:
        comm, coll = 0.0, 0.0
    elif kind is StatePlacement.HEAD_SHARDED:
        comm, coll = 2 * (T - 1) / T * N * hid * act_bytes, 1.0  # all-reduce of o's output
    else:
        comm, coll = float((N - rows_r.min()) * hid * act_bytes), 1.0  # all-gather of the owners' rows
    return LayerLoads(
        f_proj=rows_r * (heads * _kda_proj_flops_per_row_head(sizes) + _kda_replicated_flops_per_row(sizes)),
        w_read=np.where(rows_r > 0, w_rank, 0.0),
        f_att=rows_r * heads * KDA_STATE_FLOPS_PER_D2 * d * d,
        kv_read=req_r * (heads / H) * 2 * sizes.state_layer_bytes,
        slices=req_r,
        comm_bytes=comm,
        collectives=coll,
    )


def _rank_times(ld: LayerLoads, theta: Theta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank, one layer: (t_proj, t_att, the indexer's part of t_att), each stage its roofline."""
    t_proj = np.maximum(ld.f_proj / theta.flops_proj, ld.w_read / theta.bw_weights)
    t_index = np.zeros_like(t_proj)
    if ld.f_index is not None and ld.index_read is not None:
        t_index = np.maximum(ld.f_index / theta.flops_att, ld.index_read / theta.bw_kv)
    t_main = np.maximum(ld.f_att / theta.flops_att, ld.kv_read / theta.bw_kv)
    return t_proj, t_main + t_index + theta.t_seq * ld.slices, t_index


_Kind = tuple[int, LayerLoads, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _kinds_loads(layout: Layout, sizes: AttentionSizes, batch: Batch, theta: Theta,
                 page_size: int | None) -> tuple[list[_Kind], int]:
    """Each kind of layer's count, loads and per-rank times, and the busiest rank over the whole model."""
    T = theta.ranks
    coll = theta.collectives_of(layout)
    kinds = []
    for n, ix in layer_kinds(sizes):
        ld = layer_loads(layout, sizes, batch, T, theta.act_bytes, coll, page_size, ix)
        kinds.append((n, ld, _rank_times(ld, theta)))
    if sizes.cfg.is_hybrid:
        ld = kda_layer_loads(layout, sizes, batch, T, theta.act_bytes)
        kinds.append((len(sizes.kda_layers), ld, _rank_times(ld, theta)))
    per_rank = sum(n * (t[0] + t[1]) for n, _, t in kinds)
    return kinds, int(np.argmax(per_rank)) if T else 0


def step_cost(layout: Layout, sizes: AttentionSizes, batch: Batch, theta: Theta,
              page_size: int | None = None) -> StepCost:
    """Eq 10 summed over the model's attention layers (a hybrid's KDA layers included) for `batch` in
    `layout` on theta.ranks ranks."""
    L = sizes.layers
    kinds, b = _kinds_loads(layout, sizes, batch, theta, page_size)
    bw = theta.link_bw_of(layout)
    comm = kinds[0][1].comm_bytes / bw
    delta = theta.latency * kinds[0][1].collectives
    eta = theta.eta_of(layout)
    t_proj = t_att = t_index = exposed = deltas = 0.0
    for n, ld, times in kinds:
        tp, ta, ti = (float(v[b]) for v in times)
        t_proj, t_att, t_index = t_proj + n * tp, t_att + n * ta, t_index + n * ti
        exposed += n * max(0.0, ld.comm_bytes / bw - eta * ta)
        deltas += n * theta.latency * ld.collectives
    if not sizes.cfg.is_hybrid:  # every kind issues the same collectives (kept as L * delta exactly)
        deltas = L * delta
    else:
        delta = deltas / L
    total = outside_attention(theta, batch) + t_proj + t_att + deltas + exposed
    return StepCost(layout, total, t_proj / L, t_att / L, comm, delta, exposed / L, L, t_index / L)


# ---- Eq 10 as a linear function of theta, for calibration --------------------------------------------
# step_cost(...).total == step_features(...) @ theta_params(theta), with the max() branches, the busiest
# rank and the [.]+ of exposed communication fixed by `theta`: least squares on measured step times
# then fits these parameters (all >= 0) for the branches the data sit in.
FIT_PARAMS = ("t0", "t_row", "t_experts", "inv_flops_proj", "inv_bw_weights", "inv_flops_att",
              "inv_bw_kv", "inv_link_bw", "latency", "t_seq", "t_req")


def theta_params(theta: Theta) -> np.ndarray:
    """Theta's linear parameters in FIT_PARAMS order (rates inverted: seconds per FLOP or byte)."""
    return np.array([theta.t0, theta.t_row, theta.t_experts, 1 / theta.flops_proj, 1 / theta.bw_weights,
                     1 / theta.flops_att, 1 / theta.bw_kv, 1 / theta.link_bw, theta.latency, theta.t_seq,
                     theta.t_req])


def with_params(theta: Theta, params: np.ndarray, max_rate: float = 1e30) -> Theta:
    """A copy of `theta` carrying `params` (FIT_PARAMS order); a zero inverse rate becomes `max_rate`."""
    p = np.maximum(np.asarray(params, dtype=float), 0.0)
    if p.shape != (len(FIT_PARAMS),):
        raise ConfigError(f"expected {len(FIT_PARAMS)} parameters, got shape {p.shape}")

    def rate(v: float) -> float:
        return min(max_rate, 1 / v) if v > 0 else max_rate

    d = theta.to_dict()
    d.update(t0=p[0], t_row=p[1], t_experts=p[2], flops_proj=rate(p[3]), bw_weights=rate(p[4]),
             flops_att=rate(p[5]), bw_kv=rate(p[6]), link_bw=rate(p[7]), latency=p[8], t_seq=p[9],
             t_req=p[10])
    return Theta.from_dict({k: (float(v) if isinstance(v, np.floating) else v) for k, v in d.items()})


def _roofline(att: np.ndarray, flops: float, nbytes: float, theta: Theta) -> None:
    """Add one roofline's active branch to a feature row (FLOPs at 1/Phi_att, or bytes at 1/beta_KV)."""
    if flops / theta.flops_att >= nbytes / theta.bw_kv:
        att[5] += flops
    else:
        att[6] += nbytes


def _layer_features(layout: Layout, ld: LayerLoads, theta: Theta, b: int, t_att: float) -> np.ndarray:
    """One layer's part of `step_features` on busiest rank `b` (whose t_att is `t_att`)."""
    x = np.zeros(len(FIT_PARAMS))
    if ld.f_proj[b] / theta.flops_proj >= ld.w_read[b] / theta.bw_weights:
        x[3] += ld.f_proj[b]
    else:
        x[4] += ld.w_read[b]
    att = np.zeros(len(FIT_PARAMS))  # t_att of the busiest rank
    _roofline(att, ld.f_att[b], ld.kv_read[b], theta)
    if ld.f_index is not None and ld.index_read is not None:
        _roofline(att, ld.f_index[b], ld.index_read[b], theta)
    att[9] = ld.slices[b]
    x += att
    x[8] += ld.collectives
    eta = theta.eta_of(layout)
    if ld.comm_bytes / theta.link_bw_of(layout) - eta * t_att > 0:
        x[7] += ld.comm_bytes * theta.link_bw / theta.link_bw_of(layout)  # in units of 1 / link_bw
        x -= eta * att
    return x


def step_features(layout: Layout, sizes: AttentionSizes, batch: Batch, theta: Theta,
                  page_size: int | None = None) -> np.ndarray:
    """x with step_cost(layout, ...).total == x @ theta_params(theta), branches chosen by `theta`."""
    kinds, b = _kinds_loads(layout, sizes, batch, theta, page_size)
    x = np.zeros(len(FIT_PARAMS))
    rows = batch.n_rows
    x[0] = 1.0
    x[1] = rows
    x[2] = 1.0 - (1.0 - theta.expert_frac) ** rows if rows > 0 else 0.0
    x[10] = _active(batch)
    for n, ld, times in kinds:
        x += n * _layer_features(layout, ld, theta, b, float(times[1][b]))
    return x


def _active(batch: Batch) -> int:
    """Requests with rows this step."""
    return int((batch.rows > 0).sum())


def outside_attention(theta: Theta, batch: Batch) -> float:
    """Layout-independent part of a step: t0, per-row dense/MoE work, experts the rows touch, and
    per-request work outside attention."""
    rows = batch.n_rows
    touched = 1.0 - (1.0 - theta.expert_frac) ** rows if rows > 0 else 0.0
    return theta.t0 + theta.t_row * rows + theta.t_experts * touched + theta.t_req * _active(batch)


def _comm_bytes(layout: Layout, sizes: AttentionSizes, batch: Batch, T: int, b: float,
                rows_r: np.ndarray) -> float:
    """R of Eq 10 in bytes one rank receives per layer (busiest rank)."""
    if T == 1:
        return 0.0
    c = sizes.cfg
    N, d, H = batch.n_rows, c.hidden_size, sizes.heads
    allreduce = 2 * (T - 1) / T * N * d * b  # ring all-reduce of the O output [N, d]
    if layout is Layout.TP:
        return allreduce
    if layout is Layout.DP:
        return float((N - rows_r.min()) * d * b)  # all-gather: every row but my own
    if layout is Layout.CP:
        return 2 * (T - 1) / T * N * H * (c.kv_lora_rank + 1) * b  # partial outputs + LSE merge
    # DOP, Eq 4: rows to owners [N, H/T, d_q] and head slices back [N, H/T, d_z], plus O's all-reduce
    return eq4_bytes(N, H, c.kv_lora_rank, c.qk_rope_head_dim, T, b) + allreduce


def eq4_bytes(rows: int, heads: int, d_c: int, d_r: int, world: int, elem_bytes: float) -> float:
    """SPEC Eq 4, DOP's two all-to-alls: V_DOP = (1 - 1/T) * N * H * (d_q + d_z) * b, d_q = d_c + d_r,
    d_z = d_c (the group's total per layer; per rank it depends on how many rows each rank owns). The
    one definition: the cost model prices it, splash/attention/dop.py's exchange sends exactly it."""
    return (1 - 1 / world) * rows * heads * ((d_c + d_r) + d_c) * elem_bytes


def step_costs(sizes: AttentionSizes, batch: Batch, theta: Theta,
               layouts: Sequence[Layout] = LAYOUTS, page_size: int | None = None) -> dict[Layout, StepCost]:
    return {lay: step_cost(lay, sizes, batch, theta, page_size) for lay in layouts}


# ---- Eq 7: the exposed part of a layer-wise overlapped switch --------------------------------------
def exposed_switch_time(xfer: Sequence[float], comp: Sequence[float]) -> float:
    """t_exposed = t_xfer_1 + sum_{i>=2} max(0, t_xfer_i - t_comp_{i-1}) (one layer in transit)."""
    x = [float(v) for v in xfer]
    c = [float(v) for v in comp]
    if not x:
        return 0.0
    if len(c) < len(x) - 1:
        raise ConfigError(f"need compute times for {len(x) - 1} layers, got {len(c)}")
    return x[0] + sum(max(0.0, x[i] - c[i - 1]) for i in range(1, len(x)))


def layer_transfer_times(weight_bytes: np.ndarray, kv_bytes: np.ndarray, layers: int,
                         theta: Theta) -> list[float]:
    """Per-layer transfer time of a switch: busiest rank's bytes / link + one latency per collective.

    `kv_bytes` is one layer's per-rank KV ([T], every layer alike) or each layer's ([layers, T]: a DSA
    model's indexer layers carry their indexer keys, GLM-5's shared layers none, a hybrid's KDA layers
    their per-request states instead). `weight_bytes` likewise: [T] every layer alike, or [layers, T]
    (a hybrid's KDA layers move KDA projections; `manifest.switch_layer_bytes` gives both)."""
    w_b = np.asarray(weight_bytes, dtype=float)
    w = w_b.max(axis=-1, initial=0) if w_b.ndim == 2 else np.full(layers, w_b.max(initial=0))
    kv_b = np.asarray(kv_bytes, dtype=float)
    per_layer = kv_b.max(axis=-1, initial=0) if kv_b.ndim == 2 else np.full(layers, kv_b.max(initial=0))
    if len(per_layer) != layers or len(w) != layers:
        raise ConfigError(f"need KV and weight bytes for {layers} layers, got {len(per_layer)} and {len(w)}")
    n_coll = (w > 0).astype(float) + (per_layer > 0)  # nothing to move, nothing to pay
    return ((w + per_layer) / theta.link_bw + n_coll * theta.latency).tolist()


def switch_time(weight_bytes: np.ndarray, kv_bytes: np.ndarray, dst_cost: StepCost,
                theta: Theta) -> tuple[float, float]:
    """(exposed, blocking) seconds of a switch whose destination step costs `dst_cost` (`kv_bytes`: see
    `layer_transfer_times`)."""
    xfer = layer_transfer_times(weight_bytes, kv_bytes, dst_cost.layers, theta)
    comp = [dst_cost.per_layer] * dst_cost.layers
    return exposed_switch_time(xfer, comp), float(sum(xfer))
