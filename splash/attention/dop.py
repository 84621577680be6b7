"""DOP: projections head-sharded as in TP, each request's history on one owner as in DP (SPEC §3).

Per layer, on rank r holding heads H_r (H/T of them):
1. absorbed queries for all N rows, my heads: [N, H/T, d_c + d_r];
2. variable all-to-all: each owner receives its rows from every rank -> [N_r, H, d_c + d_r];
3. the owner attends its requests' latent for all heads -> [N_r, H, d_c];
4. reverse all-to-all returns each rank its head slice of every row -> [N, H/T, d_c];
5. W_UV and o_proj columns of my heads -> partial [N, d] -> all-reduce.
Row counts per owner come from the plan (no size exchange); a rank owning no rows still enters both
all-to-alls. Bytes sent by the two exchanges, summed over ranks, are exactly Eq 4 (`eq4_bytes`).
"""

from __future__ import annotations

import torch

from splash.attention.base import Layout
from splash.attention.dp import OwnerRowsCache, attend_owned
from splash.attention.tp import check_heads
from splash.model.context import ForwardContext
from splash.model.mla import MLA


def eq4_bytes(rows: int, heads: int, d_c: int, d_r: int, world: int, elem_bytes: float) -> float:
    """SPEC Eq 4: V_DOP = (1 - 1/T) * N * H * (d_q + d_z) * b, d_q = d_c + d_r, d_z = d_c
    (the group's total per layer; per rank it depends on how many rows each rank owns)."""
    return (1 - 1 / world) * rows * heads * ((d_c + d_r) + d_c) * elem_bytes


class DOPLayout(Layout):
    name = "dop"
    shards_projections = True
    kv_ownership = "owner"

    def __init__(self) -> None:
        self._own = OwnerRowsCache()

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, True, self.name)
        own = self._own.get(ctx)
        comm, world, me = ctx.comm, ctx.world, ctx.rank
        self.write_kv(layer_idx, latent_new, ctx)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)  # [N, h, d_c], [N, h, d_r], my heads
        h, d_c = q_lat.shape[1], q_lat.shape[2]
        n_me = own.counts[me]
        # Forward exchange: rows grouped by owner; I get my rows for every rank's heads.
        q = torch.cat([q_lat, q_pe], dim=-1)[own.order]
        d_q = q.shape[-1]
        recv = comm.all_to_all_var(q, own.counts, tag=layer_idx, recv_counts=[n_me] * world)
        q_all = recv.view(world, n_me, h, d_q).transpose(0, 1).reshape(n_me, world * h, d_q)
        o = attend_owned(layer_idx, self, q_all[..., :d_c], q_all[..., d_c:], own, ctx,
                         mla.softmax_scale)  # [n_me, H, d_c]
        # Reverse exchange: every rank gets its head slice of my rows, back in owner-grouped order.
        back_send = o.view(n_me, world, h, d_c).transpose(0, 1).reshape(world * n_me, h, d_c)
        back = comm.all_to_all_var(back_send, [n_me] * world, tag=layer_idx, recv_counts=own.counts)
        o_lat = torch.empty_like(back)
        o_lat[own.order] = back
        return comm.all_reduce(mla.out_heads(o_lat), tag=layer_idx)
