"""One rank's attention kernels: which kernel attends a layout's slices over the paged latent cache, and
what that choice keeps. Built once per rank from the engine's `KernelConfig` (splash/worker/load.py) and
handed to its layouts (a live switch's new layout gets the same object) and its runner (CUDA graphs).

Three kernels share one contract (docs/runtime.md): row r attends the keys of `tables[row_seq[r]]` at
positions <= row_pos[r] -> (out [n, h, d_c], lse or None):
- "native": the C kernel on CPU (`native.py`, float64/float32/bf16),
- "triton": the Triton kernel on CUDA (`triton_mla.py`, imported only when a query is on CUDA),
- "torch": the reference, plain torch ops (`batched.py` / `kernel.py`): what anything else runs, and
  what `--enforce-eager` pins (`KernelConfig.enforce_eager`: one switch for both fast kernels and CUDA
  graphs; `SPLASH_NATIVE=0` sets it).
`--attention-kernel torch|native|triton` (`SPLASH_ATTN_KERNEL`) pins a choice where it can run (tests,
benchmarks; "triton" on CPU tensors only under Triton's interpreter, TRITON_INTERPRET=1, read here once:
how CPU tests run the engine on it).

What the object keeps, per rank and never per process: the Triton module once imported, the dtypes
its compile failed for (those take the torch path on this object only), the arange tensors a CUDA
graph points at, and Triton's per-device caches (SM counts, scale tensors). The C libraries are built
and loaded by `native.py` once per process (a shared library is mapped once per process whatever
holds it; a failed build is the machine's, the same for every engine).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from splash import env
from splash.attention import native
from splash.config import KernelConfig

if TYPE_CHECKING:
    from splash.model.context import ForwardContext

log = logging.getLogger("splash.attention")


class Kernels:
    """The attention kernels of one rank (see the module docstring)."""

    def __init__(self, config: KernelConfig | None = None, device: torch.device | str | None = None) -> None:
        """`device`: the rank's; given, the kernels it may run are made ready now (C libraries built or
        loaded, Triton imported), so no step does it (nor reads where they live from the environment)."""
        self.config = config or KernelConfig()
        self.eager = self.config.enforce_eager
        pinned = self.config.attention_kernel
        self.pinned = "" if pinned in ("", "auto") else pinned  # "" | "torch" | "native" | "triton"
        self.interpret = env.triton_interpret()  # the Triton kernel may run on CPU tensors (tests)
        self.failed: set[torch.dtype] = set()  # dtypes the Triton kernel failed to compile for
        self._triton: Any = None  # the triton_mla module once imported; False when it cannot be
        self.triton_cache: Any = None  # its per-device caches (triton_mla.DeviceCache)
        self._arange: dict[tuple[torch.device, int], torch.Tensor] = {}
        kind = torch.device(device).type if device is not None else None
        if self.eager or kind is None:
            return
        if kind == "cpu" and self.pinned in ("", "native"):  # (each warns once, if it fails: the torch path)
            native.library()
            native.dsa_library()
        if (kind == "cuda" and self.pinned in ("", "triton")) or (self.pinned == "triton" and self.interpret):
            self.triton()

    def triton(self) -> Any:
        """The Triton kernel's module, imported on first use; False where it cannot be."""
        if self._triton is None:
            try:
                from splash.attention import triton_mla

                self._triton, self.triton_cache = triton_mla, triton_mla.DeviceCache()
            except Exception as e:  # no triton, or one that does not import with this torch
                log.warning("Triton MLA kernel unavailable (%s); CUDA attention uses the torch path", e)
                self._triton = False
        return self._triton

    def kernel_for(self, q: torch.Tensor) -> str:
        """The kernel that attends queries like `q` (device, dtype)."""
        if self.eager:
            return "torch"
        pinned = self.pinned
        if pinned == "torch":
            return "torch"
        if q.device.type == "cpu":
            if pinned == "triton" and self.interpret:
                mod = self.triton()  # tests: the kernel interpreted on CPU
                return "triton" if mod and q.dtype in mod.DTYPES else "torch"
            return "native" if pinned in ("", "native") and native.supports(q) else "torch"
        if q.device.type == "cuda" and pinned in ("", "triton") and q.dtype not in self.failed:
            mod = self.triton()
            if mod and q.dtype in mod.DTYPES:
                return "triton"
        return "torch"

    def supports(self, q: torch.Tensor) -> bool:
        """Whether a paged kernel (not the torch reference) attends queries like `q`."""
        return self.kernel_for(q) != "torch"

    def index_kernel(self, q: torch.Tensor, keys: torch.Tensor) -> str:
        """"native" when the C index top-k (csrc/dsa_index.c) runs queries `q` over the index-key store
        `keys` (CPU tensors of a dtype pair it was built for, not eager), else "torch"; a pinned "torch"
        (and "triton", which has no index kernel) leaves the index to torch."""
        if self.eager or self.pinned not in ("", "native"):
            return "torch"
        return "native" if native.dsa_supports(q, keys) else "torch"

    def attention(self, kernel: str, q_lat: torch.Tensor, q_pe: torch.Tensor, layer: torch.Tensor,
                  tables: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float,
                  lse: bool = False, fmt: tuple[int, float] | None = (0, 1.0)
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Absorbed-MLA attention over one pool layer through `kernel` ("native" | "triton", as
        `kernel_for` chose; the contract above); None when that kernel cannot run it after all (the
        caller takes the torch path: a Triton build that fails for a dtype warns once and is not tried
        again by this object). `fmt`: the layer's element format (`KVPool.kernel_format`; FP8 rows are
        dequantised inside the kernel's loop); None: one no kernel reads (the torch path decodes it)."""
        if fmt is None:
            return None
        if kernel == "native":
            return native.paged_attention(q_lat, q_pe, layer, tables, row_seq, row_pos, scale, lse, fmt)
        try:
            return self._triton.paged_attention(q_lat, q_pe, layer, tables, row_seq, row_pos, scale, lse, fmt,
                                                cache=self.triton_cache)
        except Exception as e:  # a compile error on this GPU: never in a graph replay (warm-up runs first)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            log.warning("Triton MLA kernel failed for %s (%s); using the torch path for it", q_lat.dtype, e)
            self.failed.add(q_lat.dtype)
            return None

    def rows_arange(self, dev: torch.device, n: int) -> torch.Tensor:
        """arange(n) on `dev`, made once per size (a captured CUDA graph keeps pointing at it)."""
        t = self._arange.get((dev, n))
        if t is None:
            t = self._arange[(dev, n)] = torch.arange(n, dtype=torch.long, device=dev)
        return t


class RowCache(native.RowCache):
    """Per step: (row_seq, row_pos) of a slice subset, on the queries' device. A CUDA decode step over
    every slice needs no copy and no sync: row r is slice r at its position, `ctx.positions` itself."""

    def __init__(self, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels

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
                got = (self.kernels.rows_arange(dev, n), ctx.positions)
            else:  # chunks or a subset: built on the host from the plan, one copy each
                host = native.RowCache()
                row_seq, row_pos = host.get(ctx, key, idx)
                got = (to_device(row_seq, dev), to_device(row_pos, dev))
            self._made[key] = got
        return got
