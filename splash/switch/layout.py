"""The switching step's attention layout: install layer i's destination state, then run the destination.

The model calls `ctx.layout.attention(i, ...)` once per layer, in order, so wrapping the destination
layout gives the switch executor its per-layer hook without touching the model. The time spent in the
hook adds up in `hook_s` (part of the switch's exposed time, splash/switch/step.py).
"""

from __future__ import annotations

import time

import torch

from splash.attention.base import AttentionLayout
from splash.model.context import ForwardContext
from splash.model.kda import KDA
from splash.model.mla import MLA
from splash.switch.executor import SwitchExecutor


class SwitchLayout(AttentionLayout):
    """Behaves as `dst` (same name and core layout) with `executor.before_layer` first."""

    def __init__(self, executor: SwitchExecutor, dst: AttentionLayout) -> None:
        if dst.name != executor.plan.dst:
            raise ValueError(f"switch plan goes to {executor.plan.dst}, the layout given is {dst.name}")
        self.executor, self.dst = executor, dst
        self.kernels = dst.kernels
        self.name = dst.name  # type: ignore[misc]
        self.core = dst.core  # type: ignore[misc]
        self.hook_s = 0.0

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        t0 = time.perf_counter()
        self.executor.before_layer(layer_idx)
        self.hook_s += time.perf_counter() - t0
        return self.dst.attention(layer_idx, mla, q_in, latent_new, ctx)

    def linear_attention(self, layer_idx: int, kda: KDA, x: torch.Tensor, ctx: ForwardContext
                         ) -> torch.Tensor:
        """A KDA layer (hybrids): its weights and request states arrive first, then the destination runs."""
        t0 = time.perf_counter()
        self.executor.before_layer(layer_idx)
        self.hook_s += time.perf_counter() - t0
        return self.dst.linear_attention(layer_idx, kda, x, ctx)
