"""DP-attention: projections replicated, each request's history on its owner rank.

A rank computes only the rows of the slices it owns, for all heads, over its own pages; a
variable-size all-gather puts every owner's [N_r, d] rows back into batch order on every rank.
Row counts per owner come from the plan, so the gather needs no size exchange.
"""

from __future__ import annotations

import torch

from splash.attention.base import AttentionLayout
from splash.attention.kernels import Kernels
from splash.attention.rows import OwnerRows, OwnerRowsCache, check_heads
from splash.core.layouts import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


def attend_owned(layer_idx: int, layout: AttentionLayout, q_lat: torch.Tensor, q_pe: torch.Tensor,
                 own: OwnerRows, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """Attention of this rank's owned rows (q_* rows in `own.mine_rows` order) over its pages."""
    return layout.attend_slices(layer_idx, own.mine, "mine", q_lat, q_pe, ctx, scale)[0]


class DPLayout(AttentionLayout):
    name = "dp"
    core = Layout.DP

    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__(kernels)
        self._own = OwnerRowsCache()

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, self)
        own = self._own.get(ctx)
        self.write_kv(layer_idx, latent_new, ctx)
        rows = own.mine_rows
        split = self.forms(ctx, "mine", own.mine, mla) if rows.numel() else None
        if split is not None:  # some owned chunk is cheaper in MHA form
            v, _ = self.attend_v(layer_idx, mla, q_in[rows], ctx.positions[rows], split, "mine", ctx)
            mine = mla.o_proj(v)
        elif rows.numel():
            q_lat, q_pe = mla.q_heads(q_in[rows], ctx.positions[rows])
            mine = mla.out_heads(attend_owned(layer_idx, self, q_lat, q_pe, own, ctx, mla.softmax_scale))
        else:  # an idle rank still joins the gather
            mine = q_in.new_zeros(0, mla.cfg.hidden_size, dtype=mla.o_w.dtype)
        gathered = ctx.comm.all_gather_var(mine, tag=layer_idx, sizes=own.counts)
        out = torch.empty_like(gathered)
        out[own.order] = gathered
        return out
