"""The CUDA paged-attention kernel: absorbed MLA decode over the paged latent cache, in Triton.

The same contract as the CPU kernel (`native.paged_attention`, docs/runtime.md): row r attends the keys
of page table `tables[row_seq[r]]` (local page ids, -1 = not held on this rank) at positions
<= `row_pos[r]`; keys are the cache rows `[c_kv ++ k_pe]`, values their first d_c columns; a row with no
visible key gets out 0 and lse -inf, so CP/DOP partials still merge exactly. Imported only when a query
is on CUDA (`splash/attention/kernels.py`), or by tests under Triton's CPU interpreter (TRITON_INTERPRET=1).

Why this shape: one program per (row, block of heads, split of the row's keys). All of a row's heads
share its keys (MLA has one latent "head"), so a block of heads reads each key page once; the keys of
a long row are cut into `splits` parts (flash-decoding) so a small batch still fills the GPU, and the
parts are merged by log-sum-exp. The number of splits depends on the row and head counts only, never on
the step's contexts, and every bound inside the kernel is read from device memory (row_pos, the table):
the launch needs no host sync and has the same arguments every step of a batch size, so a CUDA graph
can capture it. Scores and softmax run in float32 for bf16/fp16/fp32 (fp32 products exact: IEEE, not
TF32) and in float64 for float64 (no tensor cores: element-wise products, slow but exact to rounding).

FP8 caches (`FMT` 1: fp8_e4m3, every value FP8 times one per-layer scale; 2: fp8_ds_mla, d_c FP8 values,
a float32 scale per 128, then d_r BF16): the pool layer is bytes [pages, P, RB]; each key tile is loaded
as bytes and dequantised in registers (FP8 bitcast, scale bytes assembled into a float32: no unaligned
wide loads), then cast to the query dtype, so the dot products run as for a plain cache of that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from splash import env
from splash.kv.codec import kv_row

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MAX_SPLITS = 16
# software-pipelined key tiles: each stage holds a [BN, D] tile in shared memory (fp32: 72 KiB a stage)
_STAGES = {8: 1, 4: 2, 2: 3}
_INTERPRET = env.triton_interpret()  # (Triton reads it at import too: a process fact)


@dataclass
class DeviceCache:
    """What the launches reuse, kept by the rank's `Kernels` (splash/attention/kernels.py): each GPU's SM
    count, and the softmax scales as one-element device tensors (a CUDA graph keeps their addresses)."""

    sms: dict[int, int] = field(default_factory=dict)
    scales: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)


@triton.jit
def _mla_decode(QL, QP, KV, TAB, RSEQ, RPOS, O, LSE,
                sql_r, sql_h, sqp_r, sqp_h, stab, so_s, so_r, so_h, sl_s, sl_r,
                H, SCALE,
                P: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
                BDC: tl.constexpr, BDR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                SPLITS, USE_DOT: tl.constexpr, F64: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr, FMT: tl.constexpr = 0, RB: tl.constexpr = 0, TSCALE=1.0):
    r = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    D: tl.constexpr = DC + DR
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < H
    dc = tl.arange(0, BDC)
    dr = tl.arange(0, BDR)
    dcm = dc < DC
    drm = dr < DR
    r64 = r.to(tl.int64)
    q_lat = tl.load(QL + r64 * sql_r + heads[:, None] * sql_h + dc[None, :], mask=hm[:, None] & dcm[None, :],
                    other=0.0)
    q_pe = tl.load(QP + r64 * sqp_r + heads[:, None] * sqp_h + dr[None, :], mask=hm[:, None] & drm[None, :],
                   other=0.0)
    scale = tl.load(SCALE)  # from memory: a float argument would be float32, too coarse for float64
    seq = tl.load(RSEQ + r).to(tl.int64)
    n_keys = tl.load(RPOS + r).to(tl.int32) + 1  # keys at positions 0 .. row_pos
    per = tl.cdiv(tl.cdiv(n_keys, SPLITS), BN) * BN  # this split's share, whole key blocks
    lo = sp * per
    hi = tl.minimum(lo + per, n_keys)
    if F64:
        m_i = tl.full([BH], float("-inf"), tl.float64)
        l_i = tl.zeros([BH], dtype=tl.float64)
        acc = tl.zeros([BH, BDC], dtype=tl.float64)
    else:
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, BDC], dtype=tl.float32)
    for start in range(lo, hi, BN):
        kpos = start + tl.arange(0, BN)
        inb = kpos < hi
        page = tl.load(TAB + seq * stab + kpos // P, mask=inb, other=-1)
        ok = inb & (page >= 0)
        slot = page.to(tl.int64) * P + (kpos % P)
        if FMT == 0 or FMT == 3:  # values (3: a BF16 cache under float32 / float64 queries)
            c = tl.load(KV + slot[:, None] * D + dc[None, :], mask=ok[:, None] & dcm[None, :], other=0.0)
            kpe = tl.load(KV + slot[:, None] * D + DC + dr[None, :], mask=ok[:, None] & drm[None, :],
                          other=0.0)
            if FMT == 3:
                c, kpe = c.to(QL.dtype.element_ty), kpe.to(QL.dtype.element_ty)
        else:
            row = KV + slot[:, None] * RB
            cb = tl.load(row + dc[None, :], mask=ok[:, None] & dcm[None, :], other=0)
            c = cb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if FMT == 1:
                pb = tl.load(row + DC + dr[None, :], mask=ok[:, None] & drm[None, :], other=0)
                kpe = pb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * TSCALE
                c = c * TSCALE
            else:
                sp_ = row + DC + (dc[None, :] // 128) * 4
                sm = ok[:, None] & dcm[None, :]
                b0 = tl.load(sp_, mask=sm, other=0).to(tl.int32)
                b1 = tl.load(sp_ + 1, mask=sm, other=0).to(tl.int32)
                b2 = tl.load(sp_ + 2, mask=sm, other=0).to(tl.int32)
                b3 = tl.load(sp_ + 3, mask=sm, other=0).to(tl.int32)
                tile = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
                c = c * tl.where(sm, tile, 0.0)
                rp = row + DC + ((DC + 127) // 128) * 4 + dr[None, :] * 2  # past the tile scales
                rm = ok[:, None] & drm[None, :]
                r0 = tl.load(rp, mask=rm, other=0).to(tl.int32)  # (lo / hi: the split's bounds)
                r1 = tl.load(rp + 1, mask=rm, other=0).to(tl.int32)
                kpe = ((r0 | (r1 << 8)) << 16).to(tl.float32, bitcast=True)
            if F64:
                c, kpe = c.to(tl.float64), kpe.to(tl.float64)
            else:
                c, kpe = c.to(QL.dtype.element_ty), kpe.to(QL.dtype.element_ty)
        if UPCAST:  # the CPU interpreter's dot multiplies bf16 bit patterns: give it the exact fp32 values
            q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
            c, kpe = c.to(tl.float32), kpe.to(tl.float32)
        if USE_DOT:
            s = tl.dot(q_lat, tl.trans(c), input_precision=PREC, out_dtype=tl.float32)
            s += tl.dot(q_pe, tl.trans(kpe), input_precision=PREC, out_dtype=tl.float32)
        else:
            s = tl.sum(q_lat[:, None, :] * c[None, :, :], axis=2) + tl.sum(q_pe[:, None, :] * kpe[None, :, :],
                                                                          axis=2)
        s = s * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp() finite
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            p_v = p.to(QL.dtype.element_ty)  # probabilities rounded to the value dtype, as the torch path
            if UPCAST:
                p_v = p_v.to(tl.float32)
            pv = tl.dot(p_v, c, input_precision=PREC, out_dtype=tl.float32)
        else:
            pv = tl.sum(p[:, :, None] * c[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(O + sp * so_s + r64 * so_r + heads[:, None] * so_h + dc[None, :], out.to(O.dtype.element_ty),
             mask=hm[:, None] & dcm[None, :])
    tl.store(LSE + sp * sl_s + r64 * sl_r + heads, lse.to(LSE.dtype.element_ty), mask=hm)


def _num_sms(dev: torch.device, cache: DeviceCache) -> int:
    if dev.type != "cuda":
        return 8  # the interpreter: any small number
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in cache.sms:
        cache.sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return cache.sms[i]


def _scale(scale: float, dtype: torch.dtype, dev: torch.device, cache: DeviceCache) -> torch.Tensor:
    """The softmax scale as a one-element device tensor, made once (a CUDA graph keeps its address)."""
    key = (float(scale), dtype, dev)
    t = cache.scales.get(key)
    if t is None:
        t = cache.scales[key] = torch.full((1,), float(scale), dtype=dtype, device=dev)
    return t


def plan_splits(rows: int, head_blocks: int, dev: torch.device, cache: DeviceCache | None = None) -> int:
    """Key splits per row: enough programs for ~2 waves of the GPU. A function of the batch shape only,
    so eager and graph-captured steps of one size launch the very same kernel (same numerics)."""
    progs = max(rows * head_blocks, 1)
    return max(1, min(_MAX_SPLITS, -(-2 * _num_sms(dev, cache or DeviceCache()) // progs)))


def paged_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, layer: torch.Tensor, tables: torch.Tensor,
                    row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float, lse: bool = False,
                    fmt: tuple[int, float] = (0, 1.0), splits: int | None = None,
                    cache: DeviceCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed-MLA attention of q_lat [n, h, d_c] / q_pe [n, h, d_r] over one pool layer [pages, P, D]
    -> (out [n, h, d_c], lse [n, h] or None), as `native.paged_attention` (`fmt` too: an FP8 cache's
    byte rows are dequantised in the loop). All tensors on one device; `tables` [B, W] and
    `row_seq`/`row_pos` [n] integer. `splits` overrides `plan_splits` (tests). `cache`: the rank's
    `DeviceCache` (`Kernels.triton_cache`; None: a fresh one, for a call outside an engine)."""
    cache = cache if cache is not None else DeviceCache()
    n, h, d_c = q_lat.shape
    d_r = q_pe.shape[-1]
    P = layer.shape[1]
    kind, tscale = fmt
    want, rb = kv_row(kind, d_c, d_r, q_lat.dtype)
    if q_lat.dtype not in DTYPES:
        raise TypeError(f"triton MLA kernel: unsupported dtype {q_lat.dtype}")
    if not layer.is_contiguous() or layer.dtype != want or layer.shape[-1] != rb:
        raise ValueError("paged_attention: the pool layer must be contiguous, of q's dtype (or an FP8 "
                         "cache's bytes) and of its row width")
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    tables = tables.contiguous()
    f64 = q_lat.dtype == torch.float64
    acc = torch.float64 if f64 else torch.float32
    BH = 1 if f64 else 16  # tl.dot needs 16 rows; float64 multiplies element-wise, so one head per program
    BN = 16 if f64 else 32
    hb = -(-h // BH)
    S = splits if splits is not None else plan_splits(n, hb, q_lat.device, cache)
    dev = q_lat.device
    if S == 1:
        out = torch.empty(n, h, d_c, dtype=q_lat.dtype, device=dev)
        part_o, part_l = out[None], torch.empty(1, n, h, dtype=acc, device=dev)
    else:
        part_o = torch.empty(S, n, h, d_c, dtype=acc, device=dev)
        part_l = torch.empty(S, n, h, dtype=acc, device=dev)
    if n:
        _mla_decode[(n, hb, S)](
            q_lat, q_pe, layer, tables, row_seq, row_pos, part_o, part_l,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), tables.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
            h, _scale(scale, acc, dev, cache), P=P, DC=d_c, DR=d_r, BDC=max(16, triton.next_power_of_2(d_c)),
            BDR=max(16, triton.next_power_of_2(d_r)), BH=BH, BN=BN, SPLITS=S, USE_DOT=not f64, F64=f64,
            UPCAST=_INTERPRET and q_lat.element_size() == 2,
            PREC="ieee" if q_lat.dtype == torch.float32 else None, num_warps=4 if f64 else 8,
            num_stages=_STAGES[q_lat.element_size()], FMT=kind, RB=rb, TSCALE=float(tscale))
    if S == 1:
        return out, (part_l[0] if lse else None)
    total = torch.logsumexp(part_l, dim=0)  # [n, h]; -inf where no split saw a key
    w = torch.exp(part_l - torch.where(torch.isinf(total), torch.zeros_like(total), total))
    out = (part_o * w[..., None]).sum(dim=0).to(q_lat.dtype)
    return out, (total if lse else None)
