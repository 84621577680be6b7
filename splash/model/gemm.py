"""The model's GEMMs, with one rule for bf16/fp16 on CPUs that have no native bf16 arithmetic.

On a CPU without AVX512-BF16 or AMX (e.g. AVX2 only), torch runs a bf16 GEMM on a slow emulated path:
measured on an AVX2 VM (2 threads), [2048 x 512] x [512 x 4096] takes 522 ms in bf16 and 78 ms in
float32, and a batched [16 x 32 x 128] x [128 x 512] 52 ms against 0.9 ms. Converting both operands to
float32, multiplying there and rounding the result back to bf16 costs two casts and wins from about 8
rows of a linear (16 of a batched product) up; below that (decode GEMVs) the native kernel is as fast
or faster and is kept. vLLM's CPU engine reaches the same end through oneDNN.

The float32 product rounds once to bf16 like the native kernel (which also accumulates in float32), so
results agree to bf16 rounding (summation order aside); float32 and float64 models never take this
path, so the float64 parity standard is untouched. `--bf16-upcast off` (`SPLASH_BF16_UPCAST=0`) keeps
the native kernels everywhere, `on` (`=1`) forces the upcast on any CPU (measurements). The rule is the
process's (every model module asks `upcasts`; a rank process serves one engine at a time): `set_upcast`
sets it from the engine's config when a rank loads (splash/worker/load.py), "auto" until then.
"""

from __future__ import annotations

import functools
import platform
from typing import Any

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)
LINEAR_ROWS = 8  # rows of a linear from which the float32 detour is faster (AVX2, measured above)
BMM_ROWS = 16  # batch x rows of a batched product from which it is
GROUPED_ROWS = 64  # rows of a grouped expert GEMM (each expert's weights cast once per call)
UPCAST_MODES = ("auto", "on", "off")
# the process's rules (see the module docstring): set_upcast's, and set_gemv's (on unless a measurement
# turns it off)
_mode: dict[str, Any] = {"upcast": "auto", "gemv": True}


def cpu_flags() -> list[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_isa() -> str:
    """The widest vector ISA this CPU has (figures depend on it: bf16 is emulated without AVX512-BF16)."""
    flags = cpu_flags()
    for name, flag in (("AMX", "amx_bf16"), ("AVX-512 with BF16", "avx512_bf16"), ("AVX-512", "avx512f"),
                       ("AVX2", "avx2")):
        if flag in flags:
            return name
    return platform.machine()


@functools.cache
def _lacks_native_bf16() -> bool:
    flags = cpu_flags()
    return not any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def set_upcast(mode: str) -> None:
    """The engine's --bf16-upcast: "auto" (when the CPU lacks native bf16), "on" or "off"."""
    if mode not in UPCAST_MODES:
        raise ValueError(f"bf16 upcast must be one of {', '.join(UPCAST_MODES)}, got {mode!r}")
    _mode["upcast"] = mode


def set_gemv(on: bool) -> None:
    """One bf16/fp16 row through `torch.mv` (on, the default) or `F.linear` (measurements)."""
    _mode["gemv"] = bool(on)


def upcast_half() -> bool:
    """Whether CPU bf16/fp16 GEMMs go through float32 (this CPU lacks native bf16 arithmetic, or
    `set_upcast` said so)."""
    mode = _mode["upcast"]
    return mode == "on" if mode != "auto" else _lacks_native_bf16()


def upcasts(t: torch.Tensor, rows: int, bound: int) -> bool:
    """Whether a product of `t` over `rows` rows goes through float32 (`bound`: the rows from which the
    detour pays). Paths that must agree bit for bit ask once and follow the same answer."""
    return t.dtype in _HALF and rows >= bound and t.device.type == "cpu" and upcast_half()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through float32 for many bf16 rows on a CPU without native bf16, and as a
    matrix-vector product for one bf16/fp16 row on CPU (`gemv`)."""
    if upcasts(x, x.numel() // max(1, x.shape[-1]), LINEAR_ROWS):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    if x.dim() == 2 and x.shape[0] == 1 and b is None and gemv(x):
        return torch.mv(w, x[0]).unsqueeze(0)
    return F.linear(x, w, b)


def gemv(x: torch.Tensor) -> bool:
    """Whether one bf16/fp16 row on CPU goes through `torch.mv` rather than `F.linear`: a batch-1
    decode step is mostly such products, and torch's [1, k] x [k, n] half GEMM runs at ~11-15 GB/s of
    weights here against ~1.5-2x that for `mv` on the same weights (AVX-512 BF16 host, one thread,
    docs/performance.md "Batch 1"). Both accumulate in float32 and round once; float32/float64 never
    take it (the float64 parity standard is untouched). `set_gemv(False)` keeps F.linear (A/B runs)."""
    return x.dtype in _HALF and x.device.type == "cpu" and _mode["gemv"]


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b), through float32 for large bf16 products on a CPU without native bf16."""
    if upcasts(a, a.shape[0] * a.shape[1], BMM_ROWS):
        return torch.bmm(a.float(), b.float()).to(a.dtype)
    return torch.bmm(a, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b), through float32 for large bf16 products on a CPU without native bf16."""
    if upcasts(a, a.numel() // max(1, a.shape[-1]), BMM_ROWS):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)
