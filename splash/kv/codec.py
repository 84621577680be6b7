"""How one per-token store's rows sit in the pool: the store table's element format (`store_parts`) in torch.

A plain format keeps the values themselves (a tensor of that dtype; a cast on write and on read when it
differs from the model's). A packed format (FP8) keeps each token's row as bytes, part after part, as
`splash.core.stores.store_parts` lays them out: FP8 e4m3 values followed by their float32 scales (one
per 128), then BF16 values (the rotary key of `fp8_ds_mla`). Quantisation is per token and happens once,
as a row is written; a read (`decode`) rebuilds the model dtype's values from the bytes, and the C and
Triton kernels do the same inside their attention loops. Moves (switches, swaps) copy the bytes as they
are: nothing here is ever applied twice to a row.

Scales follow DeepSeek's FP8 caches (FlashMLA's and the indexer's): a power of two, 2^ceil(log2(amax /
448)) per group of 128, amax floored at 1e-4, so dequantisation (value x scale) is exact in every dtype.
`fp8_e4m3`'s per-layer scale (`tensor_scale`) comes from the checkpoint's `k_scale`/`kv_scale`, else 1.0
(vLLM's default when a checkpoint ships none); values beyond +-448 x scale saturate.
"""

from __future__ import annotations

import torch

from splash.core.model_config import ModelConfig
from splash.core.stores import FP8_GROUP, FP8_MAX, Part, Store, latent_parts, store_parts

FP8 = torch.float8_e4m3fn
AMAX_FLOOR = 1e-4
_TORCH = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": FP8}


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """DeepSeek's FP8 cache scale for groups of largest magnitude `amax` (float32): 2^ceil(log2(amax/448))."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(AMAX_FLOOR) / FP8_MAX)))


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [k, n] -> (FP8 values [k, n], float32 scales [k, ceil(n / group)]), a scale per `group` values."""
    k, n = x.shape
    g = -(-n // group)
    pad = g * group - n
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    scale = pow2_scale(xp.view(k, g, group).abs().amax(dim=-1))  # [k, g]
    per = scale.to(x.dtype).repeat_interleave(group, dim=1)[:, :n]
    return (x / per).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Codec:
    """One store's element format on one rank: `storage` dtype, `row` storage elements a token, and the
    encode (model dtype -> stored row) / decode (stored row -> model dtype) pair."""

    def __init__(self, parts: tuple[Part, ...], width: int, compute: torch.dtype) -> None:
        self.parts, self.width, self.compute = parts, width, compute
        self.packed = len(parts) > 1 or parts[0].dtype == "fp8"
        self.storage = torch.uint8 if self.packed else _TORCH[parts[0].dtype]
        self.row = sum(p.nbytes for p in parts) if self.packed else width

    @classmethod
    def of(cls, cfg: ModelConfig, store: Store, fmt: str, compute: torch.dtype) -> Codec:
        return cls(store_parts(cfg, store, fmt), store.width, compute)

    def encode(self, x: torch.Tensor, tensor_scale: float = 1.0) -> torch.Tensor:
        """[k, width] values -> [k, row] stored rows (quantised per token)."""
        if not self.packed:
            return x.to(self.storage)
        out, at = [], 0
        for p in self.parts:
            v = x[:, at:at + p.values]
            at += p.values
            if p.dtype == "fp8" and p.group:
                q, s = quantize_groups(v, p.group)
                out += [q.view(torch.uint8), s.view(torch.uint8)]
            elif p.dtype == "fp8":
                q = (v / tensor_scale if tensor_scale != 1.0 else v).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                out.append(q.view(torch.uint8))
            else:
                out.append(v.to(_TORCH[p.dtype]).contiguous().view(torch.uint8))
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]

    def decode(self, rows: torch.Tensor, tensor_scale: float = 1.0) -> torch.Tensor:
        """[..., row] stored rows -> [..., width] values in the model's dtype."""
        if not self.packed:
            return rows.to(self.compute)
        lead = rows.shape[:-1]
        rows = rows.reshape(-1, self.row)
        out, at = [], 0
        for p in self.parts:
            raw = rows[:, at:at + p.value_bytes].contiguous()
            at += p.value_bytes
            if p.dtype == "fp8":
                v = raw.view(FP8).to(self.compute)
                if p.group:
                    sb = p.nbytes - p.value_bytes
                    s = rows[:, at:at + sb].contiguous().view(torch.float32).to(self.compute)
                    at += sb
                    v = v * s.repeat_interleave(p.group, dim=1)[:, :p.values]
                elif tensor_scale != 1.0:  # (in the model's dtype, as the kernels multiply)
                    v = v * tensor_scale
                out.append(v)
            else:
                out.append(raw.view(_TORCH[p.dtype]).to(self.compute))
        got = torch.cat(out, dim=1) if len(out) > 1 else out[0]
        return got.view(*lead, self.width)

    @property
    def kernel_format(self) -> int:
        """What the C/Triton kernels are told about a latent row: 0 plain, 1 all FP8 with one per-layer
        scale (`fp8_e4m3`), 2 FP8 d_c in tiles of 128 with float32 scales then BF16 d_r (`fp8_ds_mla`)."""
        if not self.packed:
            return 0
        return 1 if len(self.parts) == 1 and not self.parts[0].group else 2


def kv_row(kind: int, d_c: int, d_r: int, q_dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(dtype, elements a token) of a pool layer the paged kernels read in format `kind` (`fmt[0]` of
    `KVPool.kernel_format`): the store table's latent row (`splash.core.stores.store_parts`)."""
    if kind == 0:
        return q_dtype, d_c + d_r
    if kind == 3:
        return torch.bfloat16, d_c + d_r
    fmt = "fp8_e4m3" if kind == 1 else "fp8_ds_mla"
    return torch.uint8, sum(p.nbytes for p in latent_parts(d_c, d_r, fmt))


def index_row(d: int, dtype: torch.dtype) -> int:
    """Elements a token of an index-key store takes: d values, or an FP8 row's bytes (values + scales)."""
    return Part(d, "fp8", FP8_GROUP).nbytes if dtype == torch.uint8 else d
