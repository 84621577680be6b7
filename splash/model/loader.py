"""Reading a Hugging Face checkpoint: one or many `*.safetensors` files, FP8 block dequantisation.

Tensors are read lazily by name through `safe_open` slices, so a rank that holds only some heads
(or some experts, or a slice of the MLP) reads only those rows/columns from disk. FP8
(`float8_e4m3fn`) weights with a `<name>_scale_inv` block scale (DeepSeek-V3's 128x128 blocks) are
dequantised on read: in float64 when the model runs in float64 (exact: 4-bit mantissa x float32
scale), else in float32, then cast. Kimi-Linear's MoE names are mapped to DeepSeek's
(`checkpoint_name` / `internal_name`, `RenamedReader`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open

from splash.core.model_config import ConfigError

Span = tuple[int, int] | None


def span_index(nd: int, rows: Span = None, cols: Span = None, mid: Span = None) -> tuple[slice, ...]:
    """The index of a tensor's block by spans of dim 0 (`rows`), dim 1 (`mid`) and the last dim (`cols`):
    how every reader (file or in-memory) cuts a rank's share."""
    idx = [slice(None)] * nd
    if rows:
        idx[0] = slice(*rows)
    if mid:
        idx[1] = slice(*mid)
    if cols:
        idx[-1] = slice(*cols)
    return tuple(idx)
_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
                      dtype: torch.dtype) -> torch.Tensor:
    """w [R, C] (fp8) times its per-block scale [ceil(R/bm), ceil(C/bn)] -> dtype."""
    bm, bn = int(block[0]), int(block[1])
    work = torch.float64 if dtype == torch.float64 else torch.float32
    r, c = w.shape
    s = scale_inv.to(work).repeat_interleave(bm, 0)[:r].repeat_interleave(bn, 1)[:, :c]
    return (w.to(work) * s).to(dtype)


class CheckpointReader:
    """Name -> tensor access over a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | os.PathLike[str], quantization_config: dict | None = None) -> None:
        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        self.where: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                wm = json.load(f).get("weight_map", {})
            self.where = {k: os.path.join(self.path, v) for k, v in wm.items()}
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise ConfigError(f"no *.safetensors weights in {self.path!r}")
            for fn in files:
                full = os.path.join(self.path, fn)
                with safe_open(full, framework="pt") as h:
                    for k in h.keys():
                        self.where[k] = full
        self._handles: dict[str, object] = {}
        q = quantization_config or {}
        self.block = tuple(q.get("weight_block_size") or (128, 128))

    def keys(self) -> list[str]:
        return list(self.where)

    def has(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        fn = self.where.get(name)
        if fn is None:
            raise ConfigError(f"checkpoint {self.path!r} lacks tensor {name!r}; is config.json the one "
                              f"these weights were saved with?")
        h = self._handles.get(fn)
        if h is None:
            h = self._handles[fn] = safe_open(fn, framework="pt")
        return h.get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def _read(self, name: str, rows: Span, cols: Span, mid: Span = None) -> torch.Tensor:
        """Read a block: `rows` spans dim 0, `cols` the last dim, `mid` dim 1 of a 3-D tensor."""
        sl = self._slice(name)
        nd = len(sl.get_shape())
        if not (rows or cols or mid):
            return sl[...]  # (a 0-dim scalar too, e.g. an FP8 KV `k_scale`)
        if mid and nd != 3:
            raise ValueError(f"{name}: a dim-1 span needs a 3-D tensor, this one has {nd} dims")
        return sl[span_index(nd, rows, cols, mid)]

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str | None = None,
            rows: Span = None, cols: Span = None, mid: Span = None) -> torch.Tensor:
        """Tensor `name`, dequantised and cast to dtype. rows/cols: half-open spans of dim 0 / the last
        dim (a 2-D weight's rows and columns, a stacked 3-D expert tensor's experts and inputs); mid:
        dim 1 of a 3-D tensor. Only the asked block is read from disk."""
        scale_name = name + "_scale_inv"
        if name.endswith(".weight") and self.has(scale_name):
            if mid or len(self.shape(name)) != 2:
                raise ConfigError(f"{name}: FP8 block scales are supported for 2-D weights only")
            t = self._read_fp8(name, scale_name, dtype, rows, cols)
        else:
            t = self._read(name, rows, cols, mid)
            if t.dtype in _FP8:
                raise ConfigError(f"{name} is stored in {t.dtype} without {scale_name}; cannot dequantise")
            t = t.to(dtype)
        return t.to(device).contiguous() if device is not None else t.contiguous()

    def _read_fp8(self, name: str, scale_name: str, dtype: torch.dtype, rows: Span, cols: Span
                  ) -> torch.Tensor:
        bm, bn = self.block
        shape = self.shape(name)
        r0, r1 = rows or (0, shape[0])
        c0, c1 = cols or (0, shape[1])
        # widen to whole blocks, dequantise, then trim to the asked span
        br0, br1 = r0 // bm, -(-r1 // bm)
        bc0, bc1 = c0 // bn, -(-c1 // bn)
        w = self._read(name, (br0 * bm, min(br1 * bm, shape[0])), (bc0 * bn, min(bc1 * bn, shape[1])))
        s = self._read(scale_name, (br0, br1), (bc0, bc1))
        full = dequantize_blocks(w, s, (bm, bn), dtype)
        return full[r0 - br0 * bm: r1 - br0 * bm, c0 - bc0 * bn: c1 - bc0 * bn]

    def close(self) -> None:
        self._handles.clear()


# ---- checkpoint names of model families whose tensors are named differently ---------------------------
# Kimi-Linear's checkpoints (and transformers' save_pretrained of KimiLinearForCausalLM) name a layer's
# MLP / MoE `block_sparse_moe` and its routed experts' projections w1 (gate), w3 (up), w2 (down); splash's
# modules read DeepSeek's names (`mlp`, gate_proj / up_proj / down_proj). KDA layers' own names
# (q_conv1d, A_log, ...) are read as they are by splash/model/kda.py.
_KIMI_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_KIMI_EXPERT_BACK = {v: k for k, v in _KIMI_EXPERT.items()}


def checkpoint_name(model_type: str, name: str) -> str:
    """A tensor's name in `model_type`'s checkpoints, from splash's (DeepSeek's) name."""
    if model_type != "kimi_linear" or ".mlp." not in name:
        return name
    parts = name.replace(".mlp.", ".block_sparse_moe.", 1).split(".")
    # model.layers.N.block_sparse_moe.experts.J.gate_proj.weight
    if len(parts) == 8 and parts[4] == "experts" and parts[5].isdigit() and parts[6] in _KIMI_EXPERT:
        parts[6] = _KIMI_EXPERT[parts[6]]
    return ".".join(parts)


def internal_name(model_type: str, name: str) -> str:
    """The inverse of `checkpoint_name`: splash's name of a checkpoint tensor."""
    if model_type != "kimi_linear" or ".block_sparse_moe." not in name:
        return name
    parts = name.replace(".block_sparse_moe.", ".mlp.", 1).split(".")
    if len(parts) == 8 and parts[4] == "experts" and parts[5].isdigit() and parts[6] in _KIMI_EXPERT_BACK:
        parts[6] = _KIMI_EXPERT_BACK[parts[6]]
    return ".".join(parts)


class RenamedReader:
    """A reader asked with splash's names that reads the checkpoint's (`checkpoint_name`)."""

    def __init__(self, reader: Any, model_type: str) -> None:
        self.reader, self.model_type = reader, model_type
        self.path = getattr(reader, "path", "")

    def _n(self, name: str) -> str:
        return checkpoint_name(self.model_type, name)

    def keys(self) -> list[str]:
        return [internal_name(self.model_type, k) for k in self.reader.keys()]

    def has(self, name: str) -> bool:
        return self.reader.has(self._n(name))

    def shape(self, name: str) -> list[int]:
        return self.reader.shape(self._n(name))

    def get(self, name: str, *args: Any, **kw: Any) -> torch.Tensor:
        return self.reader.get(self._n(name), *args, **kw)

    def close(self) -> None:
        self.reader.close()


KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.kv_scale", "self_attn.attn.k_scale")


def kv_scales(path: str | os.PathLike[str], layers: Sequence[int]) -> dict[int, float]:
    """The per-layer FP8 KV scales a checkpoint ships (vLLM's `k_scale` / `kv_scale` scalars of an MLA
    layer: stored value = latent / scale), by model layer; {} when it ships none (scale 1.0 then)."""
    reader = CheckpointReader(path)
    try:
        out: dict[int, float] = {}
        for i in layers:
            for tail in KV_SCALE_NAMES:
                name = f"model.layers.{i}.{tail}"
                if reader.has(name):
                    v = float(reader.get(name, torch.float64).reshape(-1)[0])
                    if not v > 0:
                        raise ConfigError(f"{name} = {v}: an FP8 KV scale must be positive")
                    out[i] = v
                    break
        return out
    finally:
        reader.close()
