"""The one attention-kernel interface: which kernel attends a layout's slices over the paged latent cache.

Every layout's `attend_slices` asks here. Three kernels share one contract (docs/runtime.md): row r
attends the keys of `tables[row_seq[r]]` at positions <= row_pos[r] -> (out [n, h, d_c], lse or None):
- "native": the C kernel on CPU (`native.py`, float64/float32/bf16),
- "triton": the Triton kernel on CUDA (`triton_mla.py`, imported only when a query is on CUDA),
- "torch": the reference, plain torch ops (`batched.py` / `kernel.py`): what anything else runs, and
  what `--enforce-eager` pins (`KernelConfig.enforce_eager`: one switch for both fast kernels and CUDA
  graphs; the environment override SPLASH_NATIVE=0 sets it, splash/config.py).
`SPLASH_ATTN_KERNEL=torch|native|triton` forces a choice where it can run (tests, benchmarks; "triton"
on CPU tensors only under Triton's interpreter, TRITON_INTERPRET=1: how CPU tests run the engine on it).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from splash.attention import native

if TYPE_CHECKING:
    from splash.model.context import ForwardContext

log = logging.getLogger("splash.attention")
KERNELS = ("torch", "native", "triton")
_triton: Any = None  # the triton_mla module once imported; False when it cannot be
_failed: set[torch.dtype] = set()  # dtypes the Triton kernel failed to compile for (torch path then)
_arange: dict[tuple[torch.device, int], torch.Tensor] = {}


def _triton_module() -> Any:
    global _triton
    if _triton is None:
        try:
            from splash.attention import triton_mla

            _triton = triton_mla
        except Exception as e:  # no triton, or one that does not import with this torch
            log.warning("Triton MLA kernel unavailable (%s); CUDA attention uses the torch path", e)
            _triton = False
    return _triton


def kernel_for(q: torch.Tensor, eager: bool = False) -> str:
    """The kernel that attends queries like `q` (device, dtype); `eager` (--enforce-eager, the layout's
    `KernelConfig`) pins the torch reference."""
    if eager:
        return "torch"
    forced = os.environ.get("SPLASH_ATTN_KERNEL") or ""  # (a lookup per layer: kept this cheap)
    if forced:
        forced = forced.strip().lower()
        if forced == "torch":
            return "torch"
    if q.device.type == "cpu":
        if forced == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            mod = _triton_module()  # tests: the kernel interpreted on CPU
            return "triton" if mod and q.dtype in mod.DTYPES else "torch"
        return "native" if forced in ("", "native") and native.supports(q) else "torch"
    if q.device.type == "cuda" and forced in ("", "triton") and q.dtype not in _failed:
        mod = _triton_module()
        if mod and q.dtype in mod.DTYPES:
            return "triton"
    return "torch"


def supports(q: torch.Tensor, eager: bool = False) -> bool:
    """Whether a paged kernel (not the torch reference) attends queries like `q`."""
    return kernel_for(q, eager) != "torch"


def attention(kernel: str, q_lat: torch.Tensor, q_pe: torch.Tensor, layer: torch.Tensor,
              tables: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float,
              lse: bool = False, fmt: tuple[int, float] | None = (0, 1.0)
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Absorbed-MLA attention over one pool layer through `kernel` ("native" | "triton", as `kernel_for`
    chose; the contract above); None when that kernel cannot run it after all (the caller takes the torch
    path: a Triton build that fails for a dtype warns once and is not tried again). `fmt`: the layer's
    element format (`KVPool.kernel_format`; FP8 rows are dequantised inside the kernel's loop); None:
    one no kernel reads (the torch path decodes it)."""
    if fmt is None:
        return None
    if kernel == "native":
        return native.paged_attention(q_lat, q_pe, layer, tables, row_seq, row_pos, scale, lse, fmt)
    try:
        return _triton.paged_attention(q_lat, q_pe, layer, tables, row_seq, row_pos, scale, lse, fmt)
    except Exception as e:  # a compile error on this GPU: never during a graph replay (warm-up runs first)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        log.warning("Triton MLA kernel failed for %s (%s); using the torch path for it", q_lat.dtype, e)
        _failed.add(q_lat.dtype)
        return None


class RowCache(native.RowCache):
    """Per step: (row_seq, row_pos) of a slice subset, on the queries' device. A CUDA decode step over
    every slice needs no copy and no sync: row r is slice r at its position, `ctx.positions` itself."""

    def get_on(self, ctx: ForwardContext, key: str, idx: list[int] | None, dev: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if dev.type == "cpu":
            return self.get(ctx, key, idx)
        from splash.model.context import to_device

        if self._ctx is not ctx:
            self._ctx, self._made = ctx, {}
        got = self._made.get(key)
        if got is None:
            n = ctx.num_rows
            if idx is None and n == len(ctx.seqs) and ctx.positions.device == dev:  # decode: 1 row a slice
                got = (rows_arange(dev, n), ctx.positions)
            else:  # chunks or a subset: built on the host from the plan, one copy each
                host = native.RowCache()
                row_seq, row_pos = host.get(ctx, key, idx)
                got = (to_device(row_seq, dev), to_device(row_pos, dev))
            self._made[key] = got
        return got


def rows_arange(dev: torch.device, n: int) -> torch.Tensor:
    """arange(n) on `dev`, made once per size (a captured CUDA graph keeps pointing at it)."""
    t = _arange.get((dev, n))
    if t is None:
        t = _arange[(dev, n)] = torch.arange(n, dtype=torch.long, device=dev)
    return t
