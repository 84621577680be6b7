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

import ctypes
import functools
import os
import platform
from typing import Any

import torch
import torch.nn.functional as F

from splash.model.clib import Library

_HALF = (torch.bfloat16, torch.float16)
LINEAR_ROWS = 8  # rows of a linear from which the float32 detour is faster (AVX2, measured above)
BMM_ROWS = 16  # batch x rows of a batched product from which it is
GROUPED_ROWS = 64  # rows of a grouped expert GEMM (each expert's weights cast once per call)
UPCAST_MODES = ("auto", "on", "off")
NATIVE_ROWS = 4  # bf16 rows up to which a linear runs the native few-row kernel (csrc/gemv.c, measured)
# the process's rules (see the module docstring): set_upcast's, set_gemv's (on unless a measurement turns
# it off) and set_native's (off under --enforce-eager)
_mode: dict[str, Any] = {"upcast": "auto", "gemv": True, "native": True}
_vp, _i64 = ctypes.c_void_p, ctypes.c_int64
_lib = Library(os.path.join(os.path.dirname(__file__), "csrc", "gemv.c"), ["gemv_bf16", "heads_bf16"],
               {"gemv_bf16": [_vp, _i64, _i64, _i64, _vp, _i64, _i64, _vp, _i64, _i64],
                "heads_bf16": [_vp, _i64, _i64, _vp, _i64, _i64, _i64, _i64, _vp, _i64, _i64, _i64]},
               "few-row GEMV kernel")


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


def set_native(on: bool) -> None:
    """The native few-row bf16 kernels (csrc/gemv.c) on (the default) or off (`--enforce-eager`: the
    engine's rule, set when a rank loads, splash/worker/load.py)."""
    _mode["native"] = bool(on)


def _native(x: torch.Tensor, w: torch.Tensor) -> ctypes.CDLL | None:
    """The few-row kernel library where it runs these operands (bf16 on CPU, the one-row rule on, built)."""
    if (x.dtype is not torch.bfloat16 or w.dtype is not torch.bfloat16 or x.device.type != "cpu"
            or not (_mode["native"] and _mode["gemv"])):
        return None
    return _lib.get()


def few_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [m, k] times w [n, k]^T -> [m, n] for 1 <= m <= native_rows() bf16 rows on CPU through csrc/gemv.c
    (each weight element read once for all rows, float sums, one rounding: as torch's kernels, in another
    summation order); None where it does not run (the caller's torch op then does)."""
    if (x.dim() != 2 or w.dim() != 2 or not 1 <= x.shape[0] <= native_rows() or x.shape[1] != w.shape[1]
            or x.stride(1) != 1 or w.stride(1) != 1):
        return None
    lib = _native(x, w)
    if lib is None:
        return None
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    lib.gemv_bf16(w.data_ptr(), n, k, w.stride(0), x.data_ptr(), m, x.stride(0), y.data_ptr(), n,
                  torch.get_num_threads())
    return y


def native_rows() -> int:
    """Rows up to which a linear takes the native kernel: NATIVE_ROWS with AVX512-BF16 (its `vdpbf16ps`
    loops), one elsewhere (the portable loop widens every element per row: at 4 rows it ran at half
    torch's speed, at one row 1.4-3x faster; measured with the AVX2 build on the AMD host)."""
    return 1 if _lacks_native_bf16() else NATIVE_ROWS


def mv(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch.mv(w, v), through the native kernel where it runs (`few_rows`)."""
    y = few_rows(v.unsqueeze(0), w)
    return torch.mv(w, v) if y is None else y[0]


def heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head products x [n, h, a] (any row/head strides) times w [h, a, b] -> [n, h, b]: MLA's W_UK
    absorption and W_UV. One bf16 row on CPU runs csrc/gemv.c's `heads_bf16` (torch's bmm reads the
    weights at ~15-20 GB/s there, the kernel at ~50), anything else `bmm` over the heads."""
    if x.shape[0] == 1 and x.stride(-1) == 1 and w.is_contiguous() and w.shape[:2] == x.shape[1:]:
        lib = _native(x, w)
        if lib is not None:
            n, h, a = x.shape
            b = w.shape[2]
            y = torch.empty(n, h, b, dtype=x.dtype)
            lib.heads_bf16(x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), h, a, b, n, y.data_ptr(),
                           h * b, b, torch.get_num_threads())
            return y
    return bmm(x.transpose(0, 1), w).transpose(0, 1)


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
    """F.linear(x, w, b), through float32 for many bf16 rows on a CPU without native bf16, the native
    few-row kernel for up to NATIVE_ROWS bf16 rows on CPU (`few_rows`), else a matrix-vector product for
    one bf16/fp16 row on CPU (`gemv`)."""
    if upcasts(x, x.numel() // max(1, x.shape[-1]), LINEAR_ROWS):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    if b is None and x.dim() == 2 and x.shape[0] <= NATIVE_ROWS:
        y = few_rows(x, w)
        if y is not None:
            return y
        if x.shape[0] == 1 and gemv(x):
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
