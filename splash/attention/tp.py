"""TP: every rank holds H/T heads' projections and every request's latent (replicated pages).

Each rank attends all N rows over every history for its own heads, applies W_UV and its column
slice of o_proj, and one all-reduce sums the head partials into the replicated [N, d].
"""

from __future__ import annotations

import torch

from splash.attention.base import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


def check_heads(mla: MLA, ctx: ForwardContext, sharded: bool, layout: str) -> None:
    """Refuse an MLA holding the wrong heads for this layout (a switch left half done, or a bug)."""
    h, world, rank = mla.total_heads, ctx.world, ctx.rank
    want = range(rank * (h // world), (rank + 1) * (h // world)) if sharded else range(h)
    if mla.heads != want:
        raise RuntimeError(f"{layout}: rank {rank} of {world} must hold heads {want}, its MLA holds "
                           f"{mla.heads}; build the model with attn_sharded={sharded} or switch first")


class TPLayout(Layout):
    name = "tp"
    shards_projections = True
    kv_ownership = "all"

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, True, self.name)
        return ctx.comm.all_reduce(self.attend_out(layer_idx, mla, q_in, latent_new, ctx), tag=layer_idx)
