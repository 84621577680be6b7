"""DP-attention: projections replicated, each request's history on its owner rank.

A rank computes only the rows of the slices it owns, for all heads, over its own pages; a
variable-size all-gather puts every owner's [N_r, d] rows back into batch order on every rank.
Row counts per owner come from the plan, so the gather needs no size exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splash.attention.base import AttentionLayout
from splash.attention.tp import check_heads
from splash.core.layouts import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


@dataclass
class OwnerRows:
    """Rows of a step grouped by owner rank (batch order kept inside each group)."""

    counts: list[int]          # counts[r] = rows owned by rank r
    order: torch.Tensor        # [N] row ids, owner 0's rows first, then owner 1's, ...
    mine: list[int]            # this rank's slices (positions in ctx.seqs), batch order
    mine_rows: torch.Tensor    # [counts[rank]] row ids of this rank's slices

    @classmethod
    def of(cls, ctx: ForwardContext, idx: list[int] | None = None) -> OwnerRows:
        """Of the slices `idx` (positions in ctx.seqs, batch order; None: all)."""
        world = ctx.world
        groups: list[list[int]] = [[] for _ in range(world)]
        ks = range(len(ctx.seqs)) if idx is None else idx
        for s in (ctx.seqs[k] for k in ks):
            if not 0 <= s.owner < world:
                raise ValueError(f"request {s.req_id}: owner rank {s.owner} outside 0..{world - 1}")
            groups[s.owner].extend(range(s.row_start, s.row_start + s.num_new))
        dev = ctx.positions.device

        def lt(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.long, device=dev)

        mine = [k for k in ks if ctx.seqs[k].owner == ctx.rank]
        return cls(counts=[len(g) for g in groups], order=lt([i for g in groups for i in g]), mine=mine,
                   mine_rows=lt(groups[ctx.rank]))


class OwnerRowsCache:
    """Per-step OwnerRows, computed at the first layer and reused by the others."""

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._rows: OwnerRows | None = None

    def get(self, ctx: ForwardContext, idx: list[int] | None = None) -> OwnerRows:
        if self._ctx is not ctx or self._rows is None:
            self._ctx, self._rows = ctx, OwnerRows.of(ctx, idx)
        return self._rows


def attend_owned(layer_idx: int, layout: AttentionLayout, q_lat: torch.Tensor, q_pe: torch.Tensor,
                 own: OwnerRows, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """Attention of this rank's owned rows (q_* rows in `own.mine_rows` order) over its pages."""
    return layout.attend_slices(layer_idx, own.mine, "mine", q_lat, q_pe, ctx, scale)[0]


class DPLayout(AttentionLayout):
    name = "dp"
    core = Layout.DP

    def __init__(self) -> None:
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
