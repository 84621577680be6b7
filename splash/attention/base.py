"""The Layout interface: how one MLA layer's attention is split over the ranks.

A layout receives the replicated per-token parts computed by the model (`q_in`, `latent_new`) and
returns the attention output for *all* N rows, complete and replicated on every rank. It decides
which heads the rank's MLA holds (`shards_projections`) and which ranks store which tokens' latent
(`kv_ownership`, realised by the step plan's page tables).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from splash.attention.kernel import attend
from splash.model.context import ForwardContext, SliceCtx
from splash.model.mla import MLA


class Layout(ABC):
    name: ClassVar[str]
    shards_projections: ClassVar[bool]  # True: each rank holds H/T heads' q_b/W_UK/W_UV/o_proj (TP, DOP)
    kv_ownership: ClassVar[str]  # "all" (TP), "owner" (DP, DOP) or "position" (CP: page j on rank j % T)

    @abstractmethod
    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        """-> [N, d]: this layer's attention output for every row of the step."""

    # Helpers every layout uses -----------------------------------------------------------------------
    @staticmethod
    def write_kv(layer_idx: int, latent_new: torch.Tensor, ctx: ForwardContext) -> None:
        """Store new rows' latent where this rank's page tables say (slot p % P of global page p // P)."""
        if ctx.kv is not None and ctx.write_slots is not None:
            ctx.kv.write(layer_idx, ctx.write_slots, latent_new[ctx.write_rows])

    @staticmethod
    def keys(layer_idx: int, s: SliceCtx, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [m, D], positions [m]) of slice `s` that this rank holds, new rows included."""
        slots, pos = s.key_slots()
        return ctx.kv.flat_layer(layer_idx)[slots], pos

    def attend_held(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
        """Store the step's latent, then attend every slice over the pages this rank holds, for the heads
        it holds -> [N, h, d_c]. TP and the one-rank layout are exactly this plus their output step."""
        self.write_kv(layer_idx, latent_new, ctx)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
        out = torch.empty_like(q_lat)
        for s in ctx.seqs:
            keys, pos = self.keys(layer_idx, s, ctx)
            r = s.rows
            out[r] = attend(q_lat[r], q_pe[r], keys, pos, ctx.positions[r], mla.softmax_scale, lse=False)[0]
        return out
