"""The CPU kernels: paged attention (csrc/mla_paged.c) and the DSA index top-k (csrc/dsa_index.c), each
built and loaded by splash/model/clib.py (once per machine, the system C compiler, ctypes).

Why C and not torch ops: attending straight over the paged latent cache visits exactly the keys each
row sees, where the torch path gathers whole pages, pads groups to their longest context and masks
(the three cost more than the attention arithmetic on CPU); likewise the index top-k scores the keys
where they lie and selects in O(keys) instead of gathering them and sorting every score.
`--enforce-eager` (`SPLASH_NATIVE=0`) keeps the torch path, as does a machine without a C compiler (one
warning). CUDA never uses this file.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch

from splash.kv.codec import index_row, kv_row
from splash.model.clib import Library

if TYPE_CHECKING:
    from splash.model.context import ForwardContext

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SRC = os.path.join(_CSRC, "mla_paged.c")
_FUNCS = {torch.float64: "mla_paged_f64", torch.float32: "mla_paged_f32", torch.bfloat16: "mla_paged_bf16"}
_FP8_FUNCS = {dt: f"{name}_fp8" for dt, name in _FUNCS.items()}  # over an FP8 cache's byte rows
_BF16KV_FUNCS = {torch.float64: "mla_paged_f64_bf16kv", torch.float32: "mla_paged_f32_bf16kv"}  # BF16 cache
# the DSA index top-k (csrc/dsa_index.c): (score dtype, index-key pool dtype) -> function
_DSA_SRC = os.path.join(_CSRC, "dsa_index.c")
_DSA_FUNCS = {(torch.float64, torch.float64): "dsa_topk_f64", (torch.float32, torch.float32): "dsa_topk_f32",
              (torch.float32, torch.bfloat16): "dsa_topk_f32_bf16",
              (torch.float64, torch.uint8): "dsa_topk_f64_fp8",  # FP8 keys (bytes: values, then scales)
              (torch.float32, torch.uint8): "dsa_topk_f32_fp8"}
_vp, _i64 = ctypes.c_void_p, ctypes.c_int64
_MLA_ARGS = [_vp, _i64, _i64, _vp, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64, _i64, _i64,
             ctypes.c_double, _vp, _vp, _i64, _i64, _i64, ctypes.c_double]
_DSA_ARGS = [_vp, _i64, _i64, _vp, _i64, _i64, _vp, _vp, _vp, _i64, _i64, _vp, _i64, _i64, _i64, _vp, _i64,
             _i64, _i64, _i64, _vp, _vp, _vp, _i64, _i64]
_DSA_WAVE = 1 << 23  # scores the index kernel holds at once (rows past it are scored in later waves)

_mla = Library(_SRC, [*_FUNCS.values(), *_FP8_FUNCS.values(), *_BF16KV_FUNCS.values()], _MLA_ARGS,
               "attention kernel")
_dsa = Library(_DSA_SRC, list(_DSA_FUNCS.values()), _DSA_ARGS, "DSA index kernel")


def library() -> ctypes.CDLL | None:
    """The loaded attention kernel library, built on first use; None when it cannot be built."""
    return _mla.get()


def dsa_library() -> ctypes.CDLL | None:
    """The loaded DSA index top-k library (csrc/dsa_index.c), as `library()`."""
    return _dsa.get()


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel can run this query tensor's attention (CPU, a dtype it was built for)."""
    return q.device.type == "cpu" and q.dtype in _FUNCS and library() is not None


def paged_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, layer: torch.Tensor, tables: torch.Tensor,
                    row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float, lse: bool = False,
                    fmt: tuple[int, float] = (0, 1.0)) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed-MLA attention of rows q_lat [n, h, d_c] / q_pe [n, h, d_r] (any row and head strides: the
    absorbed queries are used where the projections left them) over one layer of the pool [pages, P, D].

    Row r attends the keys of page table `tables[row_seq[r]]` (local page ids, -1 = not held here) at
    positions <= row_pos[r] -> (out [n, h, d_c], lse [n, h] or None); a row with no key gets 0 / -inf.
    `fmt` (`KVPool.kernel_format`): (0, _) values of q's dtype; (1, scale) FP8 e4m3 bytes [pages, P, D]
    times a per-layer scale; (2, _) fp8_ds_mla rows [pages, P, d_c + 4 ceil(d_c / 128) + 2 d_r]; (3, _)
    BF16 values under float32/float64 queries; each row converted as the kernel loads it.
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
    kind, tscale = fmt
    want, rb = kv_row(kind, d_c, d_r, q_lat.dtype)
    if not layer.is_contiguous() or layer.dtype != want or layer.shape[-1] != rb:
        raise ValueError("paged_attention: the pool layer must be contiguous, of q's dtype (or an FP8 "
                         "cache's bytes) and of its row width")
    acc = torch.float32 if q_lat.dtype == torch.bfloat16 else q_lat.dtype
    out = torch.empty(n, h, d_c, dtype=q_lat.dtype)
    total = torch.empty(n, h, dtype=acc) if lse else None
    tables = tables.contiguous()
    row_seq, row_pos = row_seq.contiguous(), row_pos.contiguous()
    err = getattr(lib, {0: _FUNCS, 3: _BF16KV_FUNCS}.get(kind, _FP8_FUNCS)[q_lat.dtype])(
        q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
        layer.data_ptr(), tables.data_ptr(), tables.shape[1], row_seq.data_ptr(), row_pos.data_ptr(),
        n, h, d_c, d_r, P, scale, out.data_ptr(), total.data_ptr() if total is not None else 0,
        torch.get_num_threads(), rb, kind, float(tscale))
    if err:
        raise MemoryError("paged_attention: out of memory for the kernel's scratch buffers")
    return out, total


def dsa_supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the DSA index kernel runs these index queries (score dtype) over this index-key pool."""
    return (q.device.type == "cpu" and keys.device.type == "cpu" and (q.dtype, keys.dtype) in _DSA_FUNCS
            and dsa_library() is not None)


def index_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, page_size: int, tables: torch.Tensor,
               positions: torch.Tensor, k: int, rows: torch.Tensor | None = None,
               row_seq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DSA indexer's top-k straight over the paged index-key cache (csrc/dsa_index.c).

    q [N, H, d] and w [N, H] in the score dtype (any row/head strides, last dim dense), positions [N]; keys
    the layer's index-key store, contiguous [num_pages * P, d] (or [num_pages, P, d]) in the pool dtype.
    Row r is query `rows[r]` (None: row r of q), over page table `tables[row_seq[r]]` (None: tables[0];
    `tables` [B, W] or [W], local page ids, -1 = not held here): it scores every held key at a position
    <= positions[rows[r]], I = sum_h w[h] ReLU(q[h] . key), and keeps the k best by (score descending,
    position ascending) -> (scores [n, k], positions [n, k], local slots [n, k]), the selected keys in
    position order, then -inf / -1 / -1 where the row sees fewer than k keys.
    """
    lib = _dsa.lib or _dsa.get()  # (loaded already where dsa_supports said yes)
    assert lib is not None
    if q.stride(-1) != 1:
        q = q.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    N, H, d = q.shape
    row = index_row(d, keys.dtype)
    if not keys.is_contiguous() or keys.shape[-1] != row or w.shape != (N, H) or positions.shape != (N,):
        raise ValueError("index_topk: keys: a contiguous pool of q's head dim; w [N, H]; positions [N]")
    long = torch.long  # (each called per slice and layer: the checks kept cheap)
    if tables.dtype != long or tables.stride(-1) != 1:
        tables = tables.to(long).contiguous()
    if positions.dtype != long or not positions.is_contiguous():
        positions = positions.to(long).contiguous()
    if rows is not None and (rows.dtype != long or not rows.is_contiguous()):
        rows = rows.to(long).contiguous()
    if row_seq is not None and (row_seq.dtype != long or not row_seq.is_contiguous()):
        row_seq = row_seq.to(long).contiguous()
    n = rows.shape[0] if rows is not None else N
    if row_seq is not None and row_seq.shape[0] != n:
        raise ValueError("index_topk: one table row per query row")
    tstride, nt = (0, 1) if tables.dim() == 1 else (tables.stride(0), tables.shape[0])  # [W]: one table
    out_sc = torch.empty(n, k, dtype=q.dtype)
    out_pos = torch.empty(n, k, dtype=torch.long)
    out_slot = torch.empty(n, k, dtype=torch.long)
    err = getattr(lib, _DSA_FUNCS[(q.dtype, keys.dtype)])(
        q.data_ptr(), q.stride(0), q.stride(1), w.data_ptr(), w.stride(0), N,
        rows.data_ptr() if rows is not None else 0, positions.data_ptr(), keys.data_ptr(),
        keys.numel() // (page_size * row), page_size, tables.data_ptr(), tstride, tables.shape[-1], nt,
        row_seq.data_ptr() if row_seq is not None else 0, n, H, d, k, out_sc.data_ptr(),
        out_pos.data_ptr(), out_slot.data_ptr(), _DSA_WAVE, torch.get_num_threads())
    if err == 2:
        raise ValueError("index_topk: a row, table row or page id out of range")
    if err:
        raise MemoryError("index_topk: out of memory for the kernel's buffers")
    return out_sc, out_pos, out_slot


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
            P = ctx.page_size  # (the context builder's, from the pool: one holder)
            if table is None or (row_seq.numel() and (int(row_pos.max()) >= table.shape[1] * P
                                                      or int(row_seq.max()) >= table.shape[0])):
                raise ValueError("step context: a row's position lies beyond its page table")
            got = self._made[key] = (row_seq, row_pos)
        return got
