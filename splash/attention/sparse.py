"""DeepSeek Sparse Attention over the paged cache: the indexer's top-k, then MLA over just those keys.

A DSA model's step carries a `SparseStep` (ctx.sparse). Before each layer's attention the model hands
it that layer's index rows (`IndexRows`: queries, head weights, the step's new index keys, which are
stored here into the pool's "index_k" store exactly where the latent goes, so the indexer cache is
placed as the latent is in every layout). A "shared" layer (GLM-5) hands None and reuses the last
full layer's selection.

Selection rule, the same on every rank and in every layout: query t scores every key s <= t,
I[t, s] = sum_h w[t, h] ReLU(q[t, h] . k[s]), and keeps the top `index_topk` by (score descending,
position ascending): ReLU makes exact ties possible (every head's dot product <= 0 gives 0), so ties
go to the earlier position, deterministically. A query seeing at most `index_topk` keys keeps them all,
so a step whose every context fits (`max_end <= index_topk`) is dense: it runs the dense kernels
(every attention form) and only writes the index keys; `active` is that test, from the plan alone, so
every rank agrees.

Where keys live follows the layout (`AttentionLayout.select`): a rank holding every key of the slices
it attends (local, TP, DP and DOP owners) selects directly; CP, where each rank holds a position shard,
forms the global top-k from every rank's local top-k candidates (score, position), all-gathered and
merged in the same (score desc, position asc) order, which equals the single-rank selection exactly
(`CPLayout.select`). Then each rank attends the selected keys it holds (`attend_selected`), with the
log-sum-exp for CP's exact merge.

Scores are float32 as in the reference (float64 for a float64 model: `indexer.score_dtype`). On CPU the
top-k runs in C (`native.index_topk`, csrc/dsa_index.c: scores straight from the paged store, an O(keys)
selection); the torch path (gather, matmuls, a stable sort) is the reference and what other devices run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from splash.attention import native
from splash.attention.kernel import acc_dtype
from splash.attention.kernels import Kernels

if TYPE_CHECKING:
    from splash.kv.pool import KVPool
    from splash.model.context import ForwardContext, SliceCtx
    from splash.model.indexer import IndexRows

_CHUNK = 1 << 22  # elements of a score block ([rows, heads, keys]) or key gather ([rows, K, D]) at once


class Selecting(Protocol):
    """Where a layout's keys live decides how it selects (`AttentionLayout.select`; CP merges ranks')."""

    def select(self, layer_idx: int, idx: list[int] | None, ctx: ForwardContext, sp: SparseStep
               ) -> torch.Tensor: ...


class SparseStep:
    """One step of a DSA model on one rank: the running layer's index rows and the selections."""

    def __init__(self, topk: int, ctx: ForwardContext, kernels: Kernels | None = None) -> None:
        self.topk = topk
        self.kernels = kernels if kernels is not None else Kernels()  # the layout's (the rank's) kernels
        self.active = ctx.max_end > topk  # some query sees more keys than it may read
        self.k = min(topk, ctx.max_end)  # selected keys per row (padded with -1), the same on every rank
        self.rows: IndexRows | None = None
        self._sel: dict[str, torch.Tensor] = {}  # subset key -> [n, k] local slots (-1: none / not here)

    def begin(self, layer: int, rows: IndexRows | None, ctx: ForwardContext) -> None:
        """Layer `layer` is next: a full layer stores its new index keys and selects afresh."""
        self.rows = rows
        if rows is None:
            if not self._sel and self.active and layer == 0:
                raise RuntimeError("a shared DSA layer needs an earlier layer with an indexer")
            return
        self._sel = {}
        kv = ctx.kv
        if kv is not None and ctx.write_slots is not None:
            new = rows.k_new if ctx.all_held else rows.k_new[ctx.write_rows]
            kv.write_store("index_k", layer, ctx.write_slots, new)

    def selection(self, layout: Selecting, layer: int, idx: list[int] | None, key: str,
                  ctx: ForwardContext) -> torch.Tensor:
        """[n, k] local slots of the keys each row of the slices `idx` attends (-1: no key / not held
        here), rows slice after slice; a shared layer gets the last full layer's."""
        got = self._sel.get(key)
        if got is not None:
            return got
        if self.rows is None:
            raise RuntimeError(f"layer {layer} shares the top-k of a layer that did not select for {key!r}")
        got = self._sel[key] = layout.select(layer, idx, ctx, self)
        return got


def rows_of(ctx: ForwardContext, idx: list[int] | None) -> torch.Tensor:
    """Step rows of the slices `idx` (None: all), slice after slice."""
    if idx is None:
        return torch.arange(ctx.positions.shape[0], device=ctx.positions.device)
    seqs = ctx.seqs
    parts = [torch.arange(seqs[k].row_start, seqs[k].row_start + seqs[k].num_new) for k in idx]
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return out.to(ctx.positions.device)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, H, d], w [n, H] (score dtype), keys [m, d] -> I [n, m] = sum_h w ReLU(q_h . k)."""
    n, h, _ = q.shape
    m = keys.shape[0]
    kt = keys.to(q.dtype).t()
    out = q.new_empty(n, m)
    step = max(1, _CHUNK // max(1, h * m))
    for a in range(0, n, step):
        b = min(n, a + step)
        s = torch.relu(torch.matmul(q[a:b], kt))  # [r, H, m]
        out[a:b] = torch.matmul(w[a:b, None, :], s)[:, 0]
    return out


def top_keys(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the `k` best columns of scores [n, m] (columns in ascending position order) by (score
    descending, column ascending) -> (scores [n, k], columns [n, k]); -inf scores mark missing keys
    (the row sees fewer than k), padded when m < k."""
    n, m = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    best = scores.gather(1, order)
    if m < k:
        best = torch.cat([best, best.new_full((n, k - m), float("-inf"))], dim=1)
        order = torch.cat([order, order.new_zeros(n, k - m)], dim=1)
    return best, order


def _kernels(ctx: ForwardContext) -> Kernels:
    """The kernels the step's SparseStep carries (the layout's); a context built by hand has none: the
    defaults (`Kernels.index_kernel` chooses the index top-k's kernel)."""
    sp = getattr(ctx, "sparse", None)
    return sp.kernels if sp is not None else Kernels()


def local_candidates(layer: int, s: SliceCtx, rows: IndexRows, q_rows: torch.Tensor, ctx: ForwardContext,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `k` keys of slice `s` among those this rank holds, for its rows `q_rows` ->
    (scores [n, k] (-inf: none), positions [n, k], local slots [n, k]; -1 where none). Callers take each
    row's keys as a set: the native kernel lists them in position order, the torch path by score."""
    kv = ctx.kv
    if kv is not None:
        store = kv.store_flat("index_k", layer)
        if _kernels(ctx).index_kernel(rows.q, store) == "native":  # scored in the pool, O(keys)
            return native.index_topk(rows.q, rows.w, store, kv.page_size, s.pages, ctx.positions, k,
                                     rows=q_rows)
    slots, pos = s.key_slots()  # held keys, positions ascending
    n = q_rows.shape[0]
    if pos.numel() == 0:
        neg = torch.full((n, k), -1, dtype=torch.long, device=q_rows.device)
        return torch.full((n, k), float("-inf"), dtype=rows.w.dtype, device=q_rows.device), neg, neg.clone()
    keys = ctx.kv.gather_store("index_k", layer, slots)
    sc = index_scores(rows.q[q_rows], rows.w[q_rows], keys)
    sc.masked_fill_(pos[None, :] > ctx.positions[q_rows][:, None], float("-inf"))  # causal
    best, col = top_keys(sc, k)
    miss = torch.isinf(best)
    return best, pos[col].masked_fill(miss, -1), slots[col].masked_fill(miss, -1)


def subset_candidates(layer: int, idx: list[int] | None, rows: IndexRows, ctx: ForwardContext, k: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`local_candidates` of every slice of `idx` (None: all), rows slice after slice, plus each row's
    slice (its index in ctx.seqs). On CPU one native call covers the whole subset (each row over its own
    row of the step's page table), so a decode batch pays the call once per layer, not per request."""
    seqs = ctx.seqs
    ks = list(range(len(seqs))) if idx is None else list(idx)
    dev = ctx.positions.device
    q_rows = rows_of(ctx, idx)
    seg = torch.repeat_interleave(torch.tensor(ks, dtype=torch.long),
                                  torch.tensor([seqs[j].num_new for j in ks], dtype=torch.long)).to(dev)
    kv = ctx.kv
    if kv is not None and ctx.page_table is not None and ks:
        store = kv.store_flat("index_k", layer)
        if _kernels(ctx).index_kernel(rows.q, store) == "native":
            sc, ps, sl = native.index_topk(rows.q, rows.w, store, kv.page_size, ctx.page_table, ctx.positions,
                                           k, rows=q_rows, row_seq=seg)
            return sc, ps, sl, seg
    if not ks:
        neg = torch.zeros(0, k, dtype=torch.long, device=dev)
        return torch.zeros(0, k, dtype=rows.w.dtype, device=dev), neg, neg.clone(), seg
    parts = [local_candidates(layer, seqs[j], rows, torch.arange(seqs[j].row_start,
                                                                  seqs[j].row_start + seqs[j].num_new,
                                                                  device=dev), ctx, k) for j in ks]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]), seg)


def attend_selected(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: KVPool, layer: int, slots: torch.Tensor,
                    scale: float, lse: bool = False, kernels: Kernels | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed MLA of each row over its selected keys: q_lat [n, h, d_c], q_pe [n, h, d_r], the pool `kv`
    and model layer `layer`, slots [n, k] (-1: none) -> (out [n, h, d_c], lse [n, h] or None). A row
    with no key here gets out 0 and lse -inf (CP merges it away). `kernels`: the layout's (default: the
    defaults)."""
    flat = kv.flat_layer(layer)
    n, h, d_c = q_lat.shape
    kernels = kernels if kernels is not None else Kernels()
    kernel = kernels.kernel_for(q_lat) if n and slots.shape[1] else "torch"
    if kernel != "torch":
        # The paged kernel (C on CPU, Triton on CUDA) over a table of single-token pages: row r's table
        # is its selected slots (-1 skipped), every entry visible, so it reads exactly the selected keys
        # straight from the pool, with no gather and no mask.
        k, dev = slots.shape[1], q_lat.device
        slots = torch.sort(slots, dim=-1).values  # in pool order: pages are read front to back
        got = kernels.attention(kernel, q_lat, q_pe, flat.view(-1, 1, flat.shape[1]), slots,
                                torch.arange(n, device=dev),
                                torch.full((n,), k - 1, dtype=torch.long, device=dev), scale, lse,
                                kv.kernel_format(layer))
        if got is not None:
            return got
    # only the selected rows decoded
    return attend_rows(q_lat, q_pe, slots, lambda sl: kv.decode(layer, flat[sl]), scale, lse)


def attend_rows(q_lat: torch.Tensor, q_pe: torch.Tensor, slots: torch.Tensor,
                fetch: Callable[[torch.Tensor], torch.Tensor], scale: float, lse: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed MLA of each row over its own keys: slots [n, k] (-1: none), `fetch(slots)` -> their
    latent values [*slots.shape, D] (a pool's, or CP's gathered context) -> (out [n, h, d_c], lse [n, h]
    or None), a block of rows at a time; a row with no key gets 0 and lse -inf."""
    n, h, d_c = q_lat.shape
    acc = acc_dtype(q_lat.dtype)
    out = q_lat.new_zeros(n, h, d_c)
    total = torch.full((n, h), float("-inf"), dtype=acc, device=q_lat.device) if lse else None
    k = slots.shape[1] if slots.dim() == 2 else 0
    if n == 0 or k == 0:
        return out, total
    q = torch.cat([q_lat, q_pe], dim=-1)  # [n, h, D]
    step = max(1, _CHUNK // max(1, k * q.shape[-1]))
    for a in range(0, n, step):
        b = min(n, a + step)
        sl = slots[a:b]
        miss = sl < 0
        keys = fetch(sl.clamp(min=0))  # [r, k, D]
        s = torch.matmul(q[a:b], keys.transpose(1, 2)).to(acc)  # [r, h, k]
        s.mul_(scale)
        s.masked_fill_(miss[:, None, :], float("-inf"))
        if total is not None:
            total[a:b] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        out[a:b] = torch.nan_to_num(torch.matmul(p.to(keys.dtype), keys[..., :d_c]), nan=0.0)
    return out, total
