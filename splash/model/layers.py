"""Small building blocks shared by the DeepSeek layers: RMSNorm and the gated (SwiGLU) MLP.

Weights are buffers, not parameters: splash only runs inference, and buffers follow `.to(device)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splash.config import ConfigError
from splash.model.loader import CheckpointReader


def check_activation(name: str) -> None:
    if name != "silu":
        raise ConfigError(f"hidden_act {name!r} is not supported; DeepSeek models use 'silu'")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as transformers does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, dtype=dtype, device=device))

    def load(self, reader: CheckpointReader, name: str, device: torch.device) -> None:
        self.weight = reader.get(name, self.weight.dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers' MLP and the MoE's shared experts."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.register_buffer("gate_proj", torch.empty(inter, hidden, dtype=dtype, device=device))
        self.register_buffer("up_proj", torch.empty(inter, hidden, dtype=dtype, device=device))
        self.register_buffer("down_proj", torch.empty(hidden, inter, dtype=dtype, device=device))

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        dt = self.gate_proj.dtype
        for n in ("gate_proj", "up_proj", "down_proj"):
            t = reader.get(f"{prefix}.{n}.weight", dt, dev)
            if t.shape != getattr(self, n).shape:
                raise ValueError(f"{prefix}.{n}.weight has shape {tuple(t.shape)}, expected "
                                 f"{tuple(getattr(self, n).shape)}; config.json does not match the weights")
            setattr(self, n, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)
