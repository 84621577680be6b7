"""CP: projections replicated, each request's history sharded by position (page j on rank j % T).

Every rank runs all N rows for all heads against the keys it stores, giving a partial output and
its log-sum-exp. The merge is split by heads: an all-to-all gives rank j every rank's partials for
head slice j, rank j merges them exactly (`kernel.merge`, in rank order), and an all-gather of the
merged slices gives every rank the same full [N, H, d_c] - bit-identical on all ranks, so each runs
the same W_UV/o_proj and no reduce is needed. A step with a chunk in MHA form (splash/attention/mha.py)
merges in value space instead ([N, H, d_v], every row through W_UV first): the merge is linear, so
that is exact too, and o_proj follows. Per rank this sends about 2(T-1)/T * N*H*d_c elements
instead of the (T-1) * N*H*d_c an all-gather of whole partials would.
"""

from __future__ import annotations

import torch

from splash.attention import sparse
from splash.attention.base import AttentionLayout
from splash.attention.kernel import merge
from splash.attention.rows import check_heads
from splash.core.layouts import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


def _by_head_slice(t: torch.Tensor, world: int) -> torch.Tensor:
    """[N, H, *rest] -> [world * N, H/world, *rest]: block j holds head slice j of every row."""
    n, h = t.shape[0], t.shape[1] // world
    rest = tuple(t.shape[2:])
    return t.reshape(n, world, h, *rest).transpose(0, 1).reshape(world * n, h, *rest)


class CPLayout(AttentionLayout):
    name = "cp"
    core = Layout.CP

    def select(self, layer_idx: int, idx: list[int] | None, ctx: ForwardContext, sp: sparse.SparseStep
               ) -> torch.Tensor:
        """DSA under CP: no rank holds every key, so each rank's top-k candidates among the keys it
        holds (score, global position) are all-gathered and merged by (score desc, position asc) into
        the global top-k, which equals the one-rank selection; each rank then keeps the selected keys
        it holds as local slots (-1 for the others)."""
        assert sp.rows is not None
        k, P = sp.k, ctx.page_size
        if ctx.world == 1:
            return super().select(layer_idx, idx, ctx, sp)
        sc, ps, _, seg = sparse.subset_candidates(layer_idx, idx, sp.rows, ctx, k)
        gpos = merge_candidates(ctx.comm.all_gather(sc.contiguous(), tag=layer_idx),
                                ctx.comm.all_gather(ps.contiguous(), tag=layer_idx), k)
        held = ctx.page_table[seg[:, None], (gpos // P).clamp(min=0)]  # this rank's page, or -1
        return torch.where((gpos >= 0) & (held >= 0), held * P + gpos % P, -1)

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, self)
        self.write_kv(layer_idx, latent_new, ctx)
        # A chunk in MHA form leaves partials in value space [N, H, d_v]: the merge is linear, so merging
        # there is exact too; then every row goes there (absorbed ones through W_UV first).
        split = self.forms(ctx, "all", None, mla, key_share=ctx.world)
        if split is None:
            q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
            # The kernel keeps the lse in float32 for bf16/fp16 models; so does the wire.
            out, lse = self.attend_slices(layer_idx, None, "all", q_lat, q_pe, ctx, mla.softmax_scale,
                                          lse=True)
            finish = mla.out_heads
        else:
            out, lse = self.attend_v(layer_idx, mla, q_in, ctx.positions, split, "all", ctx, lse=True)
            finish = mla.o_proj
        assert lse is not None
        world = ctx.world
        if world == 1:
            return finish(out)
        n, heads, d_c = out.shape
        h = heads // world
        comm, counts = ctx.comm, [n] * world
        h_o = comm.all_to_all_var_async(_by_head_slice(out, world), counts, layer_idx, counts)
        h_l = comm.all_to_all_var_async(_by_head_slice(lse, world), counts, layer_idx, counts)
        parts_o = h_o.wait().view(world, n, h, d_c).unbind(0)
        parts_l = h_l.wait().view(world, n, h).unbind(0)
        mine = merge(list(parts_o), list(parts_l))  # [N, h, d_c]: my head slice, merged exactly
        full = comm.all_gather(mine, tag=layer_idx)  # [world, N, h, d_c]
        return finish(full.transpose(0, 1).reshape(n, heads, d_c))


def merge_candidates(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Every rank's top-k candidates, scores / positions [T, n, k] (-inf / -1 padded), merged into the
    global top-k positions [n, k] (-1 padded) by (score descending, position ascending): the rule a
    single rank applies to all the keys, so the result is the single-rank selection."""
    world, n, _ = scores.shape
    sc = scores.permute(1, 0, 2).reshape(n, world * k)
    ps = positions.permute(1, 0, 2).reshape(n, world * k)
    by_pos = torch.sort(ps, dim=-1, stable=True).indices  # ties in score then go to the earlier key
    sc, ps = sc.gather(1, by_pos), ps.gather(1, by_pos)
    best, col = sparse.top_keys(sc, k)
    return ps.gather(1, col).masked_fill(torch.isinf(best), -1)
