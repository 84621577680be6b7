"""TP: every rank holds H/T heads' projections and every request's latent (replicated pages).

Each rank attends all N rows over every history for its own heads, applies W_UV and its column
slice of o_proj, and one all-reduce sums the head partials into the replicated [N, d].
"""

from __future__ import annotations

import torch

from splash.attention.base import AttentionLayout
from splash.core.layouts import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


def check_heads(mla: MLA, ctx: ForwardContext, layout: AttentionLayout) -> None:
    """Refuse an MLA holding the wrong heads for this layout (a switch left half done, or a bug)."""
    world, rank, core = ctx.world, ctx.rank, layout.core
    want = core.heads(rank, world, mla.total_heads) if core is not None else range(mla.total_heads)
    if mla.heads != want:
        raise RuntimeError(f"{layout.name}: rank {rank} of {world} must hold heads {want}, its MLA holds "
                           f"{mla.heads}; build the model with attn_sharded={layout.shards_projections} or "
                           "switch first")


class TPLayout(AttentionLayout):
    name = "tp"
    core = Layout.TP

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, self)
        return ctx.comm.all_reduce(self.attend_out(layer_idx, mla, q_in, latent_new, ctx), tag=layer_idx)
