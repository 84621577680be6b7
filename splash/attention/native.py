"""The CPU paged-attention kernel (csrc/mla_paged.c): built once per machine with the system C compiler,
loaded with ctypes, no torch headers and no build step at install time.

Why C and not torch ops: attending straight over the paged latent cache visits exactly the keys each
row sees, where the torch path gathers whole pages, pads groups to their longest context and masks
(the three cost more than the attention arithmetic on CPU). The library is compiled on first use
(about a second) into the splash cache folder, keyed by the source, the flags and the CPU, and shared
by every process; `SPLASH_NATIVE=0` (or `--enforce-eager`) keeps the torch path. A machine without a C
compiler gets the torch path too, with one warning. CUDA never uses this file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splash.model.context import ForwardContext

log = logging.getLogger("splash.attention")

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "mla_paged.c")
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared",
          "-fno-math-errno"]
_FUNCS = {torch.float64: "mla_paged_f64", torch.float32: "mla_paged_f32", torch.bfloat16: "mla_paged_bf16"}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    """The native kernel is wanted (not turned off by SPLASH_NATIVE=0)."""
    return os.environ.get("SPLASH_NATIVE", "1") not in ("0", "false", "off", "")


def set_enabled(on: bool) -> None:
    """Turn the native kernel on or off for this process and the ranks it spawns (`--enforce-eager`)."""
    os.environ["SPLASH_NATIVE"] = "1" if on else "0"


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha1(line.encode()).hexdigest()[:8]
    except OSError:
        pass
    return platform.machine()


def _build(target: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        res = subprocess.run([cc, *_FLAGS, "-o", tmp, _SRC, "-lm"], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent builders each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None when disabled or when it cannot be built."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        from splash.model.tiny import cache_dir

        with open(_SRC, "rb") as f:
            tag = hashlib.sha1(f.read() + " ".join(_FLAGS).encode()).hexdigest()[:12]
        target = os.path.join(cache_dir(), "kernels", f"mla_paged-{tag}-{_cpu_tag()}.so")
        try:
            if not os.path.isfile(target):
                _build(target)
            lib = ctypes.CDLL(target)
            for name in _FUNCS.values():
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                vp, i64 = ctypes.c_void_p, ctypes.c_int64
                fn.argtypes = [vp, i64, i64, vp, i64, i64, vp, vp, i64, vp, vp, i64, i64, i64, i64, i64,
                               ctypes.c_double, vp, vp, i64]
            _lib = lib
        except Exception as e:  # no compiler, a failed build, a library that will not load
            log.warning("native CPU attention kernel unavailable (%s); using the torch path", e)
            _lib = None
    return _lib


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel can run this query tensor's attention (CPU, a dtype it was built for)."""
    return q.device.type == "cpu" and q.dtype in _FUNCS and library() is not None


def paged_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, layer: torch.Tensor, tables: torch.Tensor,
                    row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float, lse: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed-MLA attention of rows q_lat [n, h, d_c] / q_pe [n, h, d_r] (any row and head strides: the
    absorbed queries are used where the projections left them) over one layer of the pool [pages, P, D].

    Row r attends the keys of page table `tables[row_seq[r]]` (local page ids, -1 = not held here) at
    positions <= row_pos[r] -> (out [n, h, d_c], lse [n, h] or None); a row with no key gets 0 / -inf.
    """
    lib = library()
    assert lib is not None
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    n, h, d_c = q_lat.shape
    d_r = q_pe.shape[-1]
    P = layer.shape[1]
    if not layer.is_contiguous() or layer.dtype != q_lat.dtype or layer.shape[-1] != d_c + d_r:
        raise ValueError("paged_attention: the pool layer must be contiguous, of q's dtype and width")
    acc = torch.float32 if q_lat.dtype == torch.bfloat16 else q_lat.dtype
    out = torch.empty(n, h, d_c, dtype=q_lat.dtype)
    total = torch.empty(n, h, dtype=acc) if lse else None
    tables = tables.contiguous()
    row_seq, row_pos = row_seq.contiguous(), row_pos.contiguous()
    err = getattr(lib, _FUNCS[q_lat.dtype])(
        q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
        layer.data_ptr(), tables.data_ptr(), tables.shape[1], row_seq.data_ptr(), row_pos.data_ptr(),
        n, h, d_c, d_r, P, scale, out.data_ptr(), total.data_ptr() if total is not None else 0,
        torch.get_num_threads())
    if err:
        raise MemoryError("paged_attention: out of memory for the kernel's scratch buffers")
    return out, total


class RowCache:
    """Per step: which page-table row and which position each query row of a slice subset has (the
    kernel's `row_seq` / `row_pos`), built at the first layer and reused by the others."""

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, ctx: ForwardContext, key: str, idx: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_seq, row_pos) for the slices `idx` (positions in ctx.seqs, batch order; None: all)."""
        if self._ctx is not ctx:
            self._ctx, self._made = ctx, {}
        got = self._made.get(key)
        if got is None:
            seqs = ctx.seqs
            ks = range(len(seqs)) if idx is None else idx
            if all(seqs[k].num_new == 1 for k in ks):  # decode rows: one per slice
                row_seq = torch.tensor(list(ks), dtype=torch.long)
                row_pos = torch.tensor([seqs[k].start for k in ks], dtype=torch.long)
            else:
                row_seq = torch.tensor([k for k in ks for _ in range(seqs[k].num_new)], dtype=torch.long)
                row_pos = torch.tensor([p for k in ks for p in range(seqs[k].start, seqs[k].end)],
                                       dtype=torch.long)
            # the C kernel trusts these: a row past its table would read outside it
            table = ctx.page_table
            P = ctx.kv.page_size if ctx.kv is not None else ctx.page_size
            if table is None or (row_seq.numel() and (int(row_pos.max()) >= table.shape[1] * P
                                                      or int(row_seq.max()) >= table.shape[0])):
                raise ValueError("step context: a row's position lies beyond its page table")
            got = self._made[key] = (row_seq, row_pos)
        return got
