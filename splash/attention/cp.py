"""CP: projections replicated, each request's history sharded by position (page j on rank j % T).

Every rank runs all N rows for all heads against the keys it stores, giving a partial output and
its log-sum-exp; the partials are all-gathered and merged exactly (`kernel.merge`) in rank order,
so every rank computes bit-identical merged latents and the same o_proj output - no reduce needed.
"""

from __future__ import annotations

import torch

from splash.attention.base import Layout
from splash.attention.kernel import attend, merge
from splash.attention.tp import check_heads
from splash.model.context import ForwardContext
from splash.model.mla import MLA


class CPLayout(Layout):
    name = "cp"
    shards_projections = False
    kv_ownership = "position"

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, False, self.name)
        self.write_kv(layer_idx, latent_new, ctx)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
        out = torch.empty_like(q_lat)
        # The kernel keeps the lse in float32 for bf16/fp16 models; so does the wire.
        lse_dtype = torch.float32 if q_lat.dtype in (torch.bfloat16, torch.float16) else q_lat.dtype
        lse = torch.empty(q_lat.shape[:2], dtype=lse_dtype, device=q_lat.device)
        for s in ctx.seqs:
            keys, pos = self.keys(layer_idx, s, ctx)
            r = s.rows
            out[r], lse[r] = attend(q_lat[r], q_pe[r], keys, pos, ctx.positions[r], mla.softmax_scale)
        if ctx.world > 1:
            h_out = ctx.comm.all_gather_async(out, tag=layer_idx)
            h_lse = ctx.comm.all_gather_async(lse, tag=layer_idx)
            outs, lses = h_out.wait(), h_lse.wait()
            out = merge(list(outs.unbind(0)), list(lses.unbind(0)))
        return mla.out_heads(out)
