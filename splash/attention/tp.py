"""TP: every rank holds H/T heads' projections and every request's latent (replicated pages).

Each rank attends all N rows over every history for its own heads, applies W_UV and its column
slice of o_proj, and one all-reduce sums the head partials into the replicated [N, d].
"""

from __future__ import annotations

import torch

from splash.attention.base import AttentionLayout
from splash.attention.rows import check_heads
from splash.core.layouts import Layout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


class TPLayout(AttentionLayout):
    name = "tp"
    core = Layout.TP

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, self)
        return ctx.comm.all_reduce(self.attend_out(layer_idx, mla, q_in, latent_new, ctx), tag=layer_idx)
