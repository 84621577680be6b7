"""Per-step cost model (Eq 10), exposed switch time (Eq 7) and the calibration vector theta.

Eq 10 per MLA layer and rank: t_proj = max(F_proj/Phi_proj, W/beta_W), t_att = max(F_att/Phi_att,
K_read/beta_KV), and t = t0 + t_proj + t_att + delta + max(0, R - eta*t_att). The loads F, W, K_read
and R come from the ownership model for the *live* batch (unbalanced contexts and owners welcome),
so the same function prices TP, DP, CP and DOP; theta holds only rates, latencies and budgets.
The illustrative law of Eq 11/12 lives in `splash/core/law.py`; Eq 10 written linear in theta (what
calibration fits) in `splash/core/features.py`; Eq 7, a switch's exposed time, in
`splash/core/switch_time.py`.

Sparse attention (DSA, SPEC §9): a query's main attention reads at most `index_topk` keys whatever the
context, while each indexer layer scores every visible key (H_I * d_I MACs and d_I values per key) and
runs its own projections on the rows it scores (all of them in TP, each owner's under DP and DOP, in CP
every whole row and its share of a split chunk's). The indexer is a second roofline inside t_att. GLM-5's
shared layers reuse the previous indexer's selection: sparse main attention, no indexer. Layers of one
kind cost alike, so a step is the sum over the kinds (`layer_kinds`) of count x one layer's cost.

A hybrid's KDA layers (SPEC §10) are one more kind (`kda_layer_loads`), constant per token: their
projections (t_proj) and the state update (t_att: ~8 d^2 FLOPs per row and head, and one read + write
of the state per request with rows), no context-dependent term. The share a rank computes follows the
state placement: TP/DOP each rank its heads of every row (one all-reduce after o), DP the owner's rows
(one all-gather), CP every row whole on every rank (redundant, no collective).

CP runs a step's rows two ways (splash/attention/cp.py): the rows of chunks taking the MHA form
(`splash.core.forms`: prefill) are split over the ranks by tokens, 1/T each against the whole context,
whose earlier keys are all-gathered (`spread_chunks`); the others every rank computes whole against its
position share, merged by head slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.core.forms import mha_cheaper
from splash.core.holdings import position_tokens_matrix
from splash.core.layouts import LAYOUTS, Layout, Ownership, StatePlacement, round_robin_owners
from splash.core.model_config import ConfigError
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta


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
    split = spread_chunks(layout, sizes, batch, T)
    whole = np.where(split, 0.0, q)  # rows every rank computes (CP) or their owner does (DP, DOP)
    if layout.ownership is Ownership.OWNER:
        rows_r = np.bincount(o, weights=whole, minlength=T)  # (DOP: a spread chunk's rows are no owner's)
        slices_r = np.bincount(o, weights=active, minlength=T)
    else:
        rows_r = np.full(T, whole.sum() + (q.sum() - whole.sum()) / T)  # CP: split rows 1/T each
        slices_r = np.full(T, active.sum())  # CP: every rank visits every slice (its keys may be few)
    w_rank = sizes.w_layer / T if layout.sharded else sizes.w_layer
    # Head-sharded projections (TP, DOP) run every row of the step for the rank's H/T heads (DOP's
    # exchange then brings each owner its rows); replicated ones the rows the rank attends.
    proj_rows = np.full(T, q.sum()) if layout.sharded else rows_r
    f_proj = proj_rows * heads * _proj_flops_per_row_head(sizes)
    w_read = np.where(proj_rows > 0, w_rank, 0.0)
    f_index = index_read = None
    if c.is_sparse if indexer is None else indexer:
        # Projections on the rows this rank scores (all in TP, its own in DP/DOP, CP's share of a split
        # chunk's and every whole row); scoring every visible key it holds.
        idx_rows = np.bincount(o, weights=q, minlength=T) if layout.owned else rows_r  # CP: split too
        f_proj = f_proj + idx_rows * _index_proj_flops_per_row(sizes)
        w_read = w_read + np.where(idx_rows > 0, sizes.indexer_layer_bytes, 0.0)
        scored = q * attended_keys(s, q, None)
        f_index = (_spread(layout, o, np.where(split, 0.0, scored), share, T)
                   + np.where(split, scored, 0.0).sum() / T) * _index_flops_per_key(sizes)
        index_read = (_spread(layout, o, np.where(split, 0.0, s), share, T)
                      + np.where(split, s, 0.0).sum()) * sizes.store_bytes("index_k")
    # A split chunk: each rank its 1/T of the rows (causal work even) over the whole gathered context
    f_att = _spread(layout, o, whole * keys, share, T) + np.where(split, q * keys, 0.0).sum() / T
    kv_read = _spread(layout, o, np.where(split, 0.0, read), share, T) + np.where(split, read, 0.0).sum()
    return LayerLoads(
        f_proj=f_proj,
        w_read=w_read,
        f_att=f_att * att_heads * _att_flops_per_key_head(sizes),
        kv_read=kv_read * sizes.store_bytes("latent"),
        slices=slices_r,
        comm_bytes=_comm_bytes(layout, sizes, batch, T, act_bytes, rows_r, split, f_index is not None),
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


def kinds_loads(layout: Layout, sizes: AttentionSizes, batch: Batch, theta: Theta,
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
    kinds, b = kinds_loads(layout, sizes, batch, theta, page_size)
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


def active_requests(batch: Batch) -> int:
    """Requests with rows this step."""
    return int((batch.rows > 0).sum())


def outside_attention(theta: Theta, batch: Batch) -> float:
    """Layout-independent part of a step: t0, per-row dense/MoE work, experts the rows touch, and
    per-request work outside attention."""
    rows = batch.n_rows
    touched = 1.0 - (1.0 - theta.expert_frac) ** rows if rows > 0 else 0.0
    return theta.t0 + theta.t_row * rows + theta.t_experts * touched + theta.t_req * active_requests(batch)


def spread_chunks(layout: Layout, sizes: AttentionSizes, batch: Batch, T: int) -> np.ndarray:
    """Which requests' rows are attended by every rank rather than whole on each (CP) or on their owner
    (DOP): the chunks taking the MHA form by the one rule (`splash.core.forms`, over the whole context).
    CP splits their rows by tokens (splash/attention/cp.py; a sparse DSA step too, attending the
    selected keys absorbed); DOP runs them TP-style, every rank its heads over the context gathered
    from the owner, with no Eq 4 exchange (splash/attention/dop.py; not in a sparse DSA step, which
    takes the absorbed form and the exchange throughout). Either way a rank does 1/T of their
    attention over the whole context. All False in TP and DP."""
    c, q, s = sizes.cfg, batch.rows, batch.contexts
    none = np.zeros(len(q), dtype=bool)
    if layout not in (Layout.CP, Layout.DOP) or T == 1:
        return none
    if layout is Layout.DOP and c.index_topk is not None and int(np.where(q > 0, s, 0).max(initial=0)) > \
            c.index_topk:
        return none
    return mha_cheaper(q, s, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim)


def _comm_bytes(layout: Layout, sizes: AttentionSizes, batch: Batch, T: int, b: float,
                rows_r: np.ndarray, split: np.ndarray, indexer: bool = False) -> float:
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
    # A spread chunk's earlier context (keys before its new rows, which every rank has) is gathered, as
    # stored: from its position shards (CP) or its owner (DOP)
    q, s = batch.rows, batch.contexts
    earlier = (T - 1) / T * float(np.where(split, s - q, 0).sum())
    n_whole = int(np.where(split, 0, q).sum())
    if layout is Layout.CP:
        # the whole rows' partial outputs + LSE merge; the earlier context (and on an indexer layer its
        # index keys); the split rows' outputs all-gathered
        merge = 2 * (T - 1) / T * n_whole * H * (c.kv_lora_rank + 1) * b
        per_key = sizes.store_bytes("latent") + (sizes.store_bytes("index_k") if indexer else 0.0)
        return merge + earlier * per_key + (T - 1) / T * float(np.where(split, q, 0).sum()) * d * b
    # DOP, Eq 4 as one rank receives it: its rows from every head shard, others' rows for its heads
    # (the rows not spread); the earlier context; plus O's all-reduce
    return (eq4_rank_bytes(rows_r, n_whole, H, c.kv_lora_rank, c.qk_rope_head_dim, T, b)
            + earlier * sizes.store_bytes("latent") + allreduce)


def eq4_bytes(rows: int, heads: int, d_c: int, d_r: int, world: int, elem_bytes: float) -> float:
    """SPEC Eq 4, DOP's two all-to-alls: V_DOP = (1 - 1/T) * N * H * (d_q + d_z) * b, d_q = d_c + d_r,
    d_z = d_c (the group's total per layer; per rank it depends on how many rows each rank owns). The
    one definition: the cost model prices it, splash/attention/dop.py's exchange sends exactly it."""
    return (1 - 1 / world) * rows * heads * ((d_c + d_r) + d_c) * elem_bytes


def eq4_rank_bytes(rows_r: np.ndarray, rows: int, heads: int, d_c: int, d_r: int, world: int,
                   elem_bytes: float) -> float:
    """Eq 4 at the busiest rank: owner r receives its N_r query rows for the other ranks' heads
    [N_r, H (T-1)/T, d_q] before attention, and the other owners' outputs for its own heads
    [N - N_r, H/T, d_z] after it. Summed over ranks this is `eq4_bytes`, the group's total; a rank's
    link carries ~1/T of it, which is what Eq 10's R (per rank) must charge."""
    n_r = np.asarray(rows_r, dtype=float)
    per = (n_r * heads * (world - 1) / world * (d_c + d_r) + (rows - n_r) * heads / world * d_c) * elem_bytes
    return float(per.max(initial=0.0))


def step_costs(sizes: AttentionSizes, batch: Batch, theta: Theta,
               layouts: Sequence[Layout] = LAYOUTS, page_size: int | None = None) -> dict[Layout, StepCost]:
    return {lay: step_cost(lay, sizes, batch, theta, page_size) for lay in layouts}
