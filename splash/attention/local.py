"""The single-rank layout (T = 1): every head, every page, no communication.

Every multi-rank layout degenerates to this at T = 1, so it is also the reference the others are
checked against.
"""

from __future__ import annotations

import torch

from splash.attention.base import AttentionLayout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


class LocalLayout(AttentionLayout):
    """Slice by slice through the shared kernel: the reference every batched path is checked against."""

    name = "local"
    core = None  # every layout at T = 1: all heads, every page on the one rank
    batch_slices = False

    @staticmethod
    def write_kv(layer_idx: int, latent_new: torch.Tensor, ctx: ForwardContext) -> None:
        """As the base write_kv, without the row gather when every row is stored (one rank, all pages)."""
        if ctx.kv is not None and ctx.write_slots is not None:
            rows = latent_new if ctx.all_held else latent_new[ctx.write_rows]
            ctx.kv.write(layer_idx, ctx.write_slots, rows)

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        return self.attend_out(layer_idx, mla, q_in, latent_new, ctx)


class BatchedLocalLayout(LocalLayout):
    """The one-rank layout with its slices batched (`splash.attention.batched`): what the engine runs at
    T = 1."""

    batch_slices = True
