"""Small building blocks shared by the DeepSeek layers: RMSNorm and the gated (SwiGLU) MLP.

Weights are buffers, not parameters: splash only runs inference, and buffers follow `.to(device)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splash.core.model_config import ConfigError
from splash.model import gemm
from splash.model.loader import CheckpointReader
from splash.model.shard import span


def fusable(*ws: torch.Tensor) -> bool:
    """Whether weights sharing an input may run as one GEMM of their concatenation.

    On CPU in float32/bf16/fp16 the concatenated GEMM's columns equal the separate GEMMs' bit for bit
    (tests/test_fast_paths.py); float64 (the parity reference) and accelerators keep separate GEMMs."""
    return all(w is not None and w.device.type == "cpu" and w.dtype in _FUSE_DTYPES and w.dim() == 2
               and w.shape[1] == ws[0].shape[1] for w in ws)


_FUSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_rows(*ws: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(concatenation along rows, views of it standing for each weight): no extra memory is held."""
    cat = torch.cat(ws)
    views, a = [], 0
    for w in ws:
        views.append(cat[a:a + w.shape[0]])
        a += w.shape[0]
    return cat, views


def check_activation(name: str) -> None:
    if name != "silu":
        raise ConfigError(f"hidden_act {name!r} is not supported; DeepSeek models use 'silu'")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as transformers does.

    On CPU `F.rms_norm` runs the same float32 ops (pow, mean, add, rsqrt, mul) in one call, bit for bit,
    so the per-op dispatch of the five-op Python form is paid once."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.register_buffer("weight", torch.ones(dim, dtype=dtype, device=device))

    def load(self, reader: CheckpointReader, name: str, device: torch.device) -> None:
        self.weight = reader.get(name, self.weight.dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._buffers["weight"]  # (skips nn.Module.__getattr__: this runs 4 times a layer)
        if x.device.type != "cpu":  # accelerators fuse rms_norm with other rounding: the reference form
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return w * h.to(x.dtype)
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(x, self.shape, w, self.eps)
        return w * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers' MLP and the MoE's shared experts.

    `cols` is the slice of the intermediate size this rank holds (all of it by default). A slice makes
    it tensor-parallel: gate/up column-parallel (their rows `cols`), down row-parallel (its columns
    `cols`); `forward` then returns this rank's partial sum and the caller all-reduces it (once per
    layer, together with any other partial such as the routed experts'). Whether to reduce is the
    caller's (world > 1), never this shape's: a rank whose slice happens to be whole must still join."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str | None = None,
                 cols: range | None = None):
        super().__init__()
        self.inter = inter
        self.cols = range(inter) if cols is None else cols
        n = len(self.cols)
        self.register_buffer("gate_proj", torch.empty(n, hidden, dtype=dtype, device=device))
        self.register_buffer("up_proj", torch.empty(n, hidden, dtype=dtype, device=device))
        self.register_buffer("down_proj", torch.empty(hidden, n, dtype=dtype, device=device))
        self._gate_up: torch.Tensor | None = None  # [gate; up] when fused (see `fuse`)

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        dt = self.gate_proj.dtype
        sp = span(self.cols, self.inter)
        reads = (("gate_proj", sp, None, 0), ("up_proj", sp, None, 0), ("down_proj", None, sp, 1))
        for n, rows, cols, dim in reads:
            name = f"{prefix}.{n}.weight"
            full = reader.shape(name)
            if len(full) != 2 or full[dim] != self.inter:
                raise ValueError(f"{name} has shape {tuple(full)}, but config.json gives an intermediate "
                                 f"size of {self.inter}; config.json does not match the weights")
            t = reader.get(name, dt, dev, rows=rows, cols=cols)
            if t.shape != getattr(self, n).shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} for this rank, expected "
                                 f"{tuple(getattr(self, n).shape)}; config.json does not match the weights")
            setattr(self, n, t)

    def fuse(self) -> None:
        """Run gate and up as one GEMM: `gate_proj` / `up_proj` become views of one [2n, d] tensor.
        Only where that is bit-identical (`fusable`) and silu sees whole vector blocks either way
        (a row length that is a multiple of 64), so no element takes a different rounding path."""
        b = self._buffers
        if len(self.cols) % 64 or not fusable(b["gate_proj"], b["up_proj"]):
            return
        self._gate_up, (self.gate_proj, self.up_proj) = fused_rows(b["gate_proj"], b["up_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> [N, d] (this rank's partial sum when `partial`)."""
        b = self._buffers
        gu = self._gate_up
        if gu is not None and b["gate_proj"]._base is gu and b["up_proj"]._base is gu:
            g, u = gemm.linear(x, gu).chunk(2, dim=-1)
        else:  # unfused, or the weights were replaced since (a reload, `.to()`)
            g, u = gemm.linear(x, b["gate_proj"]), gemm.linear(x, b["up_proj"])
        return gemm.linear(F.silu(g).mul_(u), b["down_proj"])
