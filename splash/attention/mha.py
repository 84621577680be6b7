"""MLA's MHA ("decompressed") form for chunks with many query rows, and the per-chunk rule choosing it.

The absorbed form scores every query row against the latent: per row, key and head it multiplies
d_c + d_r (scores) and d_c (values), after absorbing W_UK into the query and before W_UV. The MHA form
decompresses the chunk's context keys once per held head instead - k_nope = c_kv W_UK^T, v = c_kv W_UV,
k_pe shared over heads - and then runs ordinary attention with head dim d_nope + d_r and value dim d_v,
its output going straight to o_proj. With DeepSeek's dims (d_c 512, d_r 64, d_nope = d_v = 128) that
is 320 instead of 1088 multiply-adds per (row, key, head), paid for by a decompression per key: worth
it for prefill chunks (rows ~ keys), never for decode rows (one row per context). `prefers_mha` decides
per chunk by the one rule (`splash.core.forms`, which the cost model asks too); `SPLASH_ATTN_FORM=
absorbed|mha` (or the engine's `attention_form`) pins either form everywhere, for tests and
before/after measurements.

Attention is matmul, softmax, matmul in blocks of `_BLOCK` query rows (`attend_blocked`), each block
against only the keys up to its last position: causal chunks skip about half the work, and a block's
scores stay in cache. On 2 CPU cores that is 3x faster than torch's CPU flash kernel for a 512-row,
16-head chunk in bf16 (10.5 against 29 ms), whose log-sum-exp also reads 0 for a row with no key.
Scores and the softmax are float32 for bf16/fp16 (as in the absorbed kernel); the log-sum-exp CP's
exact merge needs comes with them. Causal by position: a row at position p sees the keys at positions
<= p that the caller passes (CP: only this rank's share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splash.attention.kernel import acc_dtype
from splash.core.forms import mha_cheaper
from splash.model import gemm

if TYPE_CHECKING:
    from splash.model.context import ForwardContext
    from splash.model.mla import MLA

_BLOCK = 128  # query rows per block of `attend_blocked` on CPU


def prefers_mha(rows: int, ctx: int, mla: MLA, form: str = "auto") -> bool:
    """Whether a chunk of `rows` query rows over `ctx` keys (on this rank) takes the MHA form; `form`
    (the layout's `KernelConfig.attention_form`) pins one."""
    if form != "auto":
        return form == "mha"
    return bool(mha_cheaper(rows, ctx, mla.d_c, mla.d_rope, mla.d_nope, mla.d_v))


@dataclass
class FormSplit:
    """A step's slices `idx` split by form. Rows are the caller's: slice after slice in `idx` order."""

    mha: list[int]              # slices (positions in ctx.seqs) attended in MHA form ...
    mha_rows: list[slice]       # ... and their rows
    absorbed: list[int]         # the others, in order ...
    abs_rows: torch.Tensor      # ... and their rows (all of them, in order)

    @classmethod
    def of(cls, ctx: ForwardContext, idx: list[int] | None, mla: MLA, form: str = "auto") -> FormSplit:
        """Each chunk by its rows and whole context (CP too: a rank attends its share of a split chunk's
        rows over the gathered context)."""
        seqs = ctx.seqs
        ks = range(len(seqs)) if idx is None else idx
        mha, mha_rows, absorbed, abs_rows = [], [], [], []
        at = 0
        for k in ks:
            s = seqs[k]
            if form == "mha" or (s.num_new > 1 and prefers_mha(s.num_new, s.end, mla, form)):
                mha.append(k)
                mha_rows.append(slice(at, at + s.num_new))
            else:
                absorbed.append(k)
                abs_rows.extend(range(at, at + s.num_new))
            at += s.num_new
        return cls(mha, mha_rows, absorbed, torch.tensor(abs_rows, dtype=torch.long,
                                                         device=ctx.positions.device))


class FormCache:
    """Per step: the FormSplit of each slice subset (by key), computed at the first layer; None when
    every slice of the subset takes the absorbed form (the layouts' absorbed-only path then runs)."""

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._made: dict[str, FormSplit | None] = {}

    def get(self, ctx: ForwardContext, key: str, idx: list[int] | None, mla: MLA,
            form: str = "auto") -> FormSplit | None:
        if self._ctx is not ctx:
            self._ctx, self._made = ctx, {}
        if key not in self._made:
            split = FormSplit.of(ctx, idx, mla, form)
            self._made[key] = split if split.mha else None
        return self._made[key]


def decompress(mla: MLA, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Context latent [m, d_c + d_r] -> (keys [h, m, d_nope + d_r], values [h, m, d_v]) of held heads,
    contiguous: one chunk's `decompress_t` laid out for `attend_blocked`."""
    kvt, dn = decompress_t(mla, [latent]), mla.d_nope
    k = torch.cat([kvt[:, :dn], latent[:, mla.d_c:].t().expand(kvt.shape[0], -1, -1)], dim=1)
    return k.transpose(1, 2).contiguous(), kvt[:, dn:].transpose(1, 2).contiguous()


def decompress_t(mla: MLA, latents: list[torch.Tensor]) -> torch.Tensor:
    """Several chunks' context latents [m_i, d_c + d_r] -> [h, d_nope + d_v, sum m_i]: per held head, the
    keys' k_nope and values as columns, one GEMM over all chunks (the fused weight's rows are W_UK and
    W_UV^T of each head in turn). Both halves are read in place: a chunk's k_nope^T [d_nope, m] and v^T
    [d_v, m] are row-major matrices with row stride sum m_i, which CPU BLAS multiplies as they are
    (unlike an [m, h, *] GEMM output, which would have to be copied out of), so no per-chunk copy is
    made. The fused weight is made per call (~1 ms): nothing to keep in step with weight updates,
    switches and memory release."""
    b = mla._buffers
    w_uk, w_uv = b["w_uk"], b["w_uv"]  # [h, d_nope, d_c], [h, d_c, d_v]
    h, _, d_c = w_uk.shape
    w = torch.cat([w_uk, w_uv.transpose(1, 2)], dim=1).view(-1, d_c)
    flat = latents[0] if len(latents) == 1 else torch.cat(latents)
    return gemm.matmul(w, flat[:, :d_c].t()).view(h, -1, flat.shape[0])  # float32 detour for bf16 on AVX2


def _attend_t(c: Chunk, kvt: torch.Tensor, dn: int, d_c: int, scale: float, lse: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk over its decompressed context kvt [h, d_nope + d_v, m] (`decompress_t`): scores against
    keys k^T [h, d_nope + d_r, m] (k_nope^T rows copied as they lie, k_pe^T shared over heads) in one
    GEMM, so each score is rounded once as in `attend_blocked`; values as (v^T p^T)^T straight from kvt.
    The blocking, masking and log-sum-exp are `attend_blocked`'s."""
    q = torch.cat([c.q_nope, c.q_pe], dim=-1).transpose(0, 1)  # [h, n, d_nope + d_r]
    h, n, e = q.shape
    m = kvt.shape[2]
    kt = kvt.new_empty(h, e, m)
    kt[:, :dn] = kvt[:, :dn]
    kt[:, dn:] = c.latent[:, d_c:].t()
    vt = kvt[:, dn:]

    def scores(a: int, b: int, hi: int) -> torch.Tensor:
        return gemm.bmm(q[:, a:b], kt[:, :, :hi])

    def values(p: torch.Tensor, hi: int) -> torch.Tensor:  # p [h, rows, hi] -> [rows, h, d_v]
        return gemm.bmm(vt[:, :, :hi], p.transpose(1, 2)).permute(2, 0, 1)

    return _blocked(scores, values, n, h, vt.shape[1], m, c.q_nope, c.q_pos, c.key_pos, scale, lse,
                    out=c.out)


def attend(mla: MLA, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, key_pos: torch.Tensor,
           q_pos: torch.Tensor, scale: float, lse: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk in MHA form: rows q_nope [n, h, d_nope], q_pe [n, h, d_r] over context latent
    [m, d_c + d_r] at key_pos [m] (ascending) -> (values [n, h, d_v], lse [n, h] or None). A row that
    sees no key gets 0 and lse -inf, as from the absorbed kernel."""
    return attend_many(mla, [Chunk(q_nope, q_pe, latent, key_pos, q_pos)], scale, lse)[0]


@dataclass
class Chunk:
    """One chunk's query rows and context, as `attend` takes them."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    latent: torch.Tensor
    key_pos: torch.Tensor
    q_pos: torch.Tensor
    out: torch.Tensor | None = None  # where to write the values [n, h, d_v] (then also returned), if given


_GROUP_KEYS = 8192  # context rows decompressed by one GEMM at most (bounds the step's extra memory)


def attend_many(mla: MLA, chunks: list[Chunk], scale: float, lse: bool = False
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`attend` of each chunk, decompressing the contexts of consecutive chunks together (up to
    `_GROUP_KEYS` rows per GEMM)."""
    results: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    group: list[Chunk] = []

    def flush() -> None:
        if not group:
            return
        kvt = decompress_t(mla, [c.latent for c in group])
        at = 0
        for c in group:
            m = c.latent.shape[0]
            results.append(_attend_t(c, kvt[:, :, at:at + m], mla.d_nope, mla.d_c, scale, lse))
            at += m
        group.clear()

    rows = 0
    for c in chunks:
        if c.latent.shape[0] == 0:
            flush()
            rows = 0
            n, h, _ = c.q_nope.shape
            none = torch.full((n, h), float("-inf"), dtype=acc_dtype(c.q_nope.dtype), device=c.q_nope.device)
            zeros = c.q_nope.new_zeros(n, h, mla.d_v) if c.out is None else c.out.zero_()
            results.append((zeros, none if lse else None))
            continue
        if group and rows + c.latent.shape[0] > _GROUP_KEYS:
            flush()
            rows = 0
        group.append(c)
        rows += c.latent.shape[0]
    flush()
    return results


def attend_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   key_pos: torch.Tensor, scale: float, lse: bool, block: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [h, n, E], k [h, m, E], v [h, m, d_v] -> (out [n, h, d_v], lse [n, h] or None), causal by
    position, `block` query rows at a time against only the keys up to the block's last position."""
    h, n, _ = q.shape

    def scores(a: int, b: int, hi: int) -> torch.Tensor:
        return gemm.matmul(q[:, a:b], k[:, :hi].transpose(1, 2))

    def values(p: torch.Tensor, hi: int) -> torch.Tensor:
        return gemm.matmul(p, v[:, :hi]).transpose(0, 1)

    return _blocked(scores, values, n, h, v.shape[-1], k.shape[1], q, q_pos, key_pos, scale, lse, block)


def _blocked(scores: Callable[[int, int, int], torch.Tensor],
             values: Callable[[torch.Tensor, int], torch.Tensor], n: int, h: int, d_v: int, m: int,
             like: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor,
             scale: float, lse: bool, block: int | None = None, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of n rows over m keys, `block` rows at a time (None: `_BLOCK` on CPU, all rows
    elsewhere, so no host sync per block): `scores(a, b, hi)` gives rows a:b's scores [h, b - a, hi]
    against keys :hi, `values(p, hi)` their values [b - a, h, d_v] from probabilities p [h, b - a, hi];
    written into `out` [n, h, d_v] if given (the caller's rows: no copy afterwards)."""
    acc = acc_dtype(like.dtype)
    if out is None:
        out = like.new_empty(n, h, d_v)
    total = torch.empty(n, h, dtype=acc, device=like.device) if lse else None
    cpu = like.device.type == "cpu"
    if block is None:
        block = _BLOCK if cpu else n
    for a in range(0, n, block):
        b = min(a + block, n)
        lo, hi = 0, m
        if cpu:  # keys every row of the block sees need no mask; keys past its last row are skipped
            lo, hi = (int(i) for i in torch.searchsorted(key_pos, q_pos[[a, b - 1]], right=True))
            lo = min(lo, hi)
        s = scores(a, b, hi).mul_(scale)  # [h, rows, hi]
        if lo < hi:
            s[:, :, lo:].masked_fill_((key_pos[None, lo:hi] > q_pos[a:b, None])[None], float("-inf"))
        if total is not None:
            total[a:b] = torch.logsumexp(s.to(acc), dim=-1).transpose(0, 1)
        p = torch.softmax(s, dim=-1, dtype=acc)
        if not cpu or lo == 0:  # a row may see no key (CP: none of its keys on this rank): 0, not NaN
            p = torch.nan_to_num(p, nan=0.0)
        out[a:b] = values(p.to(like.dtype), hi)
    return out, total
