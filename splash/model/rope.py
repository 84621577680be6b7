"""Rotary position embedding of the DeepSeek family, bit-for-bit as transformers computes it.

The frequencies and the cos/sin tables are computed in float32 whatever the model dtype (as the
reference does), so a float64 model reproduces the reference's logits to ~1e-12 rather than ~1e-7.
Three application styles exist (and "none" for NoPE MLA, Kimi-Linear's: `apply` returns x as it is):
- `complex` (DeepSeek-V2 in transformers): the rotary slice is rotated as complex pairs in float32,
  output kept interleaved;
- `interleave` (V3 with `rope_interleave`): pairs (x0, x1), (x2, x3)... rotated and written out
  de-interleaved ([even outputs, odd outputs]), in the model dtype;
- `half` (V3 without `rope_interleave`): the usual rotate-half layout, in the model dtype.
q_pe and k_pe go through the same style, so their dot product is what the reference computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from splash.core.model_config import ConfigError, ModelConfig


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: dict[str, Any], dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and cos/sin attention factor (transformers' `_compute_yarn_parameters`)."""
    orig = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor")
    if factor is None:
        factor = max_pos / orig
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1
    truncate = rope.get("truncate", True)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = inter * (1 - extra_factor) + extra * extra_factor
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d_qk), times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = cfg.qk_head_dim ** (-0.5)
    rope = cfg.rope_scaling
    if rope and rope.get("rope_type", "default") != "default":
        mad = rope.get("mscale_all_dim", 0)
        if mad:
            orig = rope.get("original_max_position_embeddings") or cfg.max_position_embeddings
            m = yarn_get_mscale(rope.get("factor") or cfg.max_position_embeddings / orig, mad)
            scale = scale * m * m
    return scale


class _StepTables:
    """A step's rows of the rotary tables, cast per dtype on first use and shared by every layer."""

    __slots__ = ("rows", "by_dtype")

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        t = self.by_dtype.get(dtype)
        if t is None:
            t = self.by_dtype[dtype] = self.rows.to(dtype)
        return t


class Rotary:
    """cos/sin of the rotary slice for given positions, and their application to q_pe / k_pe.

    The float32 tables are computed once per model for positions [0, capacity) and grown on demand
    (doubling), so a step only indexes them; the last step's rows are memoised, so the 2L calls of
    one step (k_pe and q_pe of every layer) cost one lookup. They are built in blocks of
    `_BLOCK` positions so that every element goes through the same vectorised cos/sin path as a
    transformers forward of any shape (a scalar tail or a thread split could round differently).
    """

    _BLOCK = 256

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
        rope = cfg.rope_scaling
        kind = (rope or {}).get("rope_type", "default")
        if kind == "default":
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_factor = 1.0
        elif kind == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(rope, dim, base, cfg.max_position_embeddings)
        else:
            raise ConfigError(f"rope type {kind!r} is not supported (DeepSeek models use 'yarn' or none)")
        self.dim = dim
        self.inv_freq = inv_freq.to(device)
        self.style = "complex" if cfg.model_type == "deepseek_v2" else (
            "interleave" if cfg.rope_interleave else "half")
        if not cfg.use_rope:  # Kimi-Linear's NoPE MLA: the d_r part of q and k is used as it is
            self.style = "none"
        # out = a * C + b * S with table row (C, S): C = cos, S = sin with its first half negated, a = x
        # in the style's order and b = a with its halves swapped; both styles are this form, bit for
        # bit (negation is exact). interleave: a = (x_even, x_odd), so out = [x_even*c - x_odd*s,
        # x_odd*c + x_even*s]; half: a = x, out = x*cos + cat(-x2, x1)*sin.
        self._table: torch.Tensor | None = None  # [capacity, 2 * dim] float32, or complex [capacity, dim/2]
        self._memo: list[tuple[torch.Tensor, Any]] = []

    def to(self, device: torch.device | str) -> Rotary:
        self.inv_freq = self.inv_freq.to(device)
        self._table, self._memo = None, []
        return self

    @property
    def capacity(self) -> int:
        return 0 if self._table is None else int(self._table.shape[0])

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """[N, d_r/2] float32 angles, exactly `position.float() * inv_freq`."""
        return positions[:, None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Table rows of these positions, computed from scratch (what the cached table holds)."""
        freqs = self.angles(positions)
        if self.style == "complex":
            return torch.polar(torch.ones_like(freqs), freqs) * self.attention_factor
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        h = self.dim // 2
        return torch.cat([cos, -sin[:, :h], sin[:, h:]], dim=-1)

    def reserve(self, n: int) -> None:
        """Make the table cover positions [0, n)."""
        cap = self.capacity
        if n <= cap:
            return
        new = max(n, 2 * cap, self._BLOCK)
        new = -(-new // self._BLOCK) * self._BLOCK
        dev = self.inv_freq.device
        blocks = [self._rows(torch.arange(a, a + self._BLOCK, device=dev))
                  for a in range(cap, new, self._BLOCK)]
        self._table = torch.cat(([self._table] if self._table is not None else []) + blocks)

    def tables(self, positions: torch.Tensor, bound: int | None = None) -> Any:
        """What `apply` needs for these positions. The last two calls' results are memoised by tensor
        identity (a step's positions, and a layout's subset of them), so the layers of one step share
        a lookup. `bound` (> every position, from the plan) spares a device sync on GPU."""
        if self.style == "none":
            return None
        for key, val in self._memo:
            if key is positions:
                return val
        if bound is None and positions.device.type == "cpu":
            bound = int(positions.max()) + 1 if positions.numel() else 0
        if bound is None:  # accelerator, no bound given: compute the rows rather than sync for one
            rows = self._rows(positions)
        else:
            self.reserve(bound)
            table = self._table
            rows = table.index_select(0, positions) if table is not None else self._rows(positions)
        out = rows if self.style == "complex" else _StepTables(rows)
        self._memo = [(positions, out), *self._memo[:1]]
        return out

    def apply(self, x: torch.Tensor, tables: Any, style: str | None = None) -> torch.Tensor:
        """Rotate x [N, h, d_r] (or [N, d_r]) by the tables of its rows' positions. `style` overrides the
        model's ("half" / "interleave"): the DSA indexer rotates its keys in its own style."""
        style = style or self.style
        if style == "none":
            return x
        if style == "complex":
            squeeze = x.dim() == 2
            if squeeze:
                x = x[:, None, :]
            # (a + ib)(c + id) in float32 written out: what torch's vectorised complex product computes
            # (its scalar tail rounds differently), so the result does not depend on the batch shape.
            xf = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = xf[..., 0], xf[..., 1]
            c, d = tables.real[:, None, :], tables.imag[:, None, :]
            out = torch.stack([a * c - b * d, a * d + b * c], dim=-1).flatten(2).type_as(x)
            return out[:, 0, :] if squeeze else out
        cs = tables.get(x.dtype)
        if x.dim() == 3:
            cs = cs[:, None, :]
        d, h = self.dim, self.dim // 2
        # a and b by views and one cat: ~3x faster on a strided q_pe than gathering both with one
        # index_select along the last dim (slow on CPU for a non-contiguous view).
        a = x.unflatten(-1, (h, 2)).transpose(-1, -2).flatten(-2) if style == "interleave" else x
        b = torch.cat([a[..., h:], a[..., :h]], dim=-1)
        return a * cs[..., :d] + b * cs[..., d:]
