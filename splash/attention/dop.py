"""DOP: projections head-sharded as in TP, each request's history on one owner as in DP (SPEC §3).

Per layer, on rank r holding heads H_r (H/T of them):
1. absorbed queries for all N rows, my heads: [N, H/T, d_c + d_r];
2. variable all-to-all: each owner receives its rows from every rank -> [N_r, H, d_c + d_r];
3. the owner attends its requests' latent for all heads -> [N_r, H, d_c];
4. reverse all-to-all returns each rank its head slice of every row -> [N, H/T, d_c];
5. W_UV and o_proj columns of my heads -> partial [N, d] -> all-reduce.
Row counts per owner come from the plan (no size exchange); a rank owning no rows still enters both
all-to-alls. Bytes sent by the two exchanges, summed over ranks, are exactly Eq 4
(`splash.core.costmodel.eq4_bytes`; the cost model prices the busiest rank's share, `eq4_rank_bytes`).

A chunk in MHA form (splash/attention/mha.py: prefill chunks) runs TP-style instead: every rank
attends it for its own heads over the chunk's context latent - the new rows' latent, which every rank
computed, plus the cached prefix, all-gathered from the owners (nothing for a first chunk). Per chunk
of n rows over m keys that sends (T-1) * (m - n) * (d_c + d_r) elements where the exchange would send
(1 - 1/T) * n * H * (2 d_c + d_r), and it spreads the chunk's attention over all T ranks instead of
its owner; the owner-side absorbed form would cost more on both counts whenever the cost rule picks
MHA (m - n < n * H), so DOP uses the same rule as the other layouts.
"""

from __future__ import annotations

import torch

from splash.attention import mha
from splash.attention.base import AttentionLayout
from splash.attention.kernels import Kernels
from splash.attention.mha import FormSplit
from splash.attention.rows import OwnerRows, OwnerRowsCache, check_heads
from splash.core.layouts import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


class DOPLayout(AttentionLayout):
    name = "dop"
    core = Layout.DOP

    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__(kernels)
        self._own = OwnerRowsCache()
        self._own_abs = OwnerRowsCache()

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, self)
        self.write_kv(layer_idx, latent_new, ctx)
        split = self.forms(ctx, "all", None, mla)
        if split is not None:
            return self._mixed(layer_idx, mla, q_in, latent_new, ctx, split)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)  # [N, h, d_c], [N, h, d_r], my heads
        o_lat = self._exchange(layer_idx, mla, q_lat, q_pe, self._own.get(ctx), ctx, "mine")
        return ctx.comm.all_reduce(mla.out_heads(o_lat), tag=layer_idx)

    def _exchange(self, layer_idx: int, mla: MLA, q_lat: torch.Tensor, q_pe: torch.Tensor, own: OwnerRows,
                  ctx: ForwardContext, key: str) -> torch.Tensor:
        """Steps 2-4 for the rows of `own` (q_* indexed by step row) -> o_lat [N, h, d_c] of those rows,
        at their step rows (other rows left unset)."""
        comm, world, me = ctx.comm, ctx.world, ctx.rank
        h, d_c = q_lat.shape[1], q_lat.shape[2]
        n_me = own.counts[me]
        # Forward exchange: rows grouped by owner; I get my rows for every rank's heads.
        q = torch.cat([q_lat, q_pe], dim=-1)[own.order]
        d_q = q.shape[-1]
        recv = comm.all_to_all_var(q, own.counts, tag=layer_idx, recv_counts=[n_me] * world)
        q_all = recv.view(world, n_me, h, d_q).transpose(0, 1).reshape(n_me, world * h, d_q)
        o = self.attend_slices(layer_idx, own.mine, key, q_all[..., :d_c], q_all[..., d_c:], ctx,
                               mla.softmax_scale)[0]  # [n_me, H, d_c]
        # Reverse exchange: every rank gets its head slice of my rows, back in owner-grouped order.
        back_send = o.view(n_me, world, h, d_c).transpose(0, 1).reshape(world * n_me, h, d_c)
        back = comm.all_to_all_var(back_send, [n_me] * world, tag=layer_idx, recv_counts=own.counts)
        o_lat = back.new_empty(q_lat.shape[0], h, d_c)
        o_lat[own.order] = back
        return o_lat

    def _mixed(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
               ctx: ForwardContext, split: FormSplit) -> torch.Tensor:
        """A step with chunks in MHA form: those TP-style over gathered latent, the rest as above."""
        q_nope, q_pe = mla.q_parts(q_in, ctx.positions)  # [N, h, *], my heads
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], mla.d_v)
        if split.absorbed:
            own = self._own_abs.get(ctx, split.absorbed)
            rows = split.abs_rows
            q_lat = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], mla.d_c)
            q_lat[rows] = mla.absorb(q_nope[rows])
            o_lat = self._exchange(layer_idx, mla, q_lat, q_pe, own, ctx, "mine.abs")
            out[rows] = mla.uv(o_lat[rows])
        prefixes = self._prefixes(layer_idx, split, ctx)
        chunks = []
        for k, rows in zip(split.mha, split.mha_rows):
            s = ctx.seqs[k]
            new = ctx.kv.as_stored(layer_idx, latent_new[rows])  # (what the pool holds: FP8 round trip)
            lat = new if k not in prefixes else torch.cat([prefixes[k], new])
            pos = torch.arange(s.end, device=lat.device)
            chunks.append(mha.Chunk(q_nope[rows], q_pe[rows], lat, pos, ctx.positions[rows]))
        for rows, (o, _) in zip(split.mha_rows, mha.attend_many(mla, chunks, mla.softmax_scale)):
            out[rows] = o
        return ctx.comm.all_reduce(mla.o_proj(out), tag=layer_idx)

    @staticmethod
    def _prefixes(layer_idx: int, split: FormSplit, ctx: ForwardContext) -> dict[int, torch.Tensor]:
        """The cached latent [start, D] of every MHA chunk with a prefix, all-gathered from the owners."""
        seqs, world = ctx.seqs, ctx.world
        withp = [k for k in split.mha if seqs[k].start > 0]
        if not withp:
            return {}
        sizes = [sum(seqs[k].start for k in withp if seqs[k].owner == r) for r in range(world)]
        kv = ctx.kv
        mine = [kv.gather(layer_idx, seqs[k].key_slots()[0][: seqs[k].start]) for k in withp
                if seqs[k].owner == ctx.rank]
        send = torch.cat(mine) if mine else torch.zeros(0, kv.dim, dtype=kv.dtype, device=kv.device)
        got = ctx.comm.all_gather_var(send, tag=layer_idx, sizes=sizes)
        out, at = {}, 0
        for r in range(world):
            for k in withp:
                if seqs[k].owner == r:
                    out[k] = got[at: at + seqs[k].start]
                    at += seqs[k].start
        return out
