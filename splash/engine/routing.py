"""Routed experts per token (routing replay for RL): which experts each MoE layer chose, on rank 0.

The router is replicated (every rank routes the same replicated rows identically), so rank 0's own
routers already see every row of a step. `RoutingRecorder` wraps each MoE layer's router on rank 0
only; while `armed` (a step where some request asked for `return_routed_experts`) it keeps the
expert ids [N, k] of every row, and `take(plan)` hands them back per slice. Nothing is recorded,
and nothing synchronises, in steps that nobody asked for.
"""

from __future__ import annotations

from typing import Any

import torch


class RoutingRecorder:
    def __init__(self, model: Any) -> None:
        self.layers = [i for i, layer in enumerate(model.layers) if layer.is_moe]
        self.k = 0
        self.armed = False
        self._rows: list[torch.Tensor] = []
        for i in self.layers:
            gate = model.layers[i].mlp.gate
            self.k = gate.k
            gate.forward = self._wrap(gate.forward)  # instance attribute: MoE calls gate.forward(x)

    def _wrap(self, fwd: Any) -> Any:
        def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w, idx = fwd(x)
            if self.armed:
                self._rows.append(idx)
            return w, idx

        return forward

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def arm(self) -> None:
        self._rows = []
        self.armed = True

    def take(self) -> torch.Tensor | None:
        """Expert ids of the last armed step: int32 [N, moe_layers, k] (sorted per row), or None if
        the step ran no MoE layer (e.g. a switch aborted before the forward)."""
        self.armed = False
        rows, self._rows = self._rows, []
        if len(rows) != len(self.layers) or not rows:
            return None
        return torch.stack([r.sort(dim=-1).values for r in rows], dim=1).to(torch.int32).cpu()


def every_layer(ids: torch.Tensor, moe_layers: list[int], num_layers: int) -> torch.Tensor:
    """SGLang's layout of routed experts: int32 [positions, num_layers, k], a dense layer's rows all 0 (SGLang
    captures into a zeroed buffer indexed by layer id, and dense layers never write it)."""
    out = torch.zeros(ids.shape[0], num_layers, ids.shape[2], dtype=torch.int32)
    out[:, moe_layers] = ids.to(torch.int32)
    return out
