"""The single-rank layout with decode rows batched: one gather + two batched matmuls per layer.

`LocalLayout` attends slice by slice, which costs ~10 small ops per request per layer; in a decode
step (one row per request) that Python/dispatch overhead dominates. Here every one-row slice of the
step is padded to the longest context and attended together; prefill chunks (many rows, one request)
still go through the shared kernel. The padded slot table and the mask depend only on the step, so
they are built once per step (first layer) and reused by every layer.
"""

from __future__ import annotations

import torch

from splash.attention.kernel import attend
from splash.attention.local import LocalLayout
from splash.model.context import ForwardContext
from splash.model.mla import MLA


class _DecodeBatch:
    """Rows, padded page table [B, W] and additive mask [B, 1, W*P] of a step's one-row slices.

    Keys are gathered by whole pages (W per slice, from the context's padded table), so the per-layer
    gather copies B*W contiguous blocks rather than B*W*P single rows."""

    def __init__(self, ctx: ForwardContext) -> None:
        dec = [k for k, s in enumerate(ctx.seqs) if s.num_new == 1]
        self.all_rows = len(dec) == len(ctx.seqs)
        self.others = [s for s in ctx.seqs if s.num_new != 1]
        self.size = len(dec)
        if not dec:
            return
        dev = ctx.positions.device
        seqs = ctx.seqs
        P = seqs[dec[0]].page_size
        end = max(seqs[k].end for k in dec)
        width = -(-end // P)
        table = ctx.page_table
        if table is None:  # a context built by hand: tables from the plan's lists
            lists = [seqs[k].all_pages[ctx.rank] for k in dec]
            table = torch.tensor([t[:width] + [-1] * (width - len(t)) for t in lists], dtype=torch.long,
                                 device=dev)
        else:
            table = table[:, :width] if self.all_rows else table[torch.tensor(dec, device=dev), :width]
        ends = torch.tensor([seqs[k].end for k in dec], dtype=torch.long, device=dev)
        valid = torch.arange(width * P, device=dev) < ends[:, None]  # [B, M]: padding past the end
        if not ctx.all_held:  # and pages this rank does not hold
            valid &= (table >= 0).repeat_interleave(P, dim=1)
        self.width = width * P
        self.pages = table.clamp(min=0).reshape(-1)  # flat, for index_select of whole pages
        dtype = ctx.kv.dtype if ctx.kv is not None else torch.float32
        # Additive mask: 0 where visible, -inf on padding and on pages this rank does not hold.
        zero = torch.zeros((), dtype=dtype, device=dev)
        self.bias = torch.where(valid[:, None, :], zero, zero - float("inf"))
        self.rows = None if self.all_rows else torch.tensor([seqs[k].row_start for k in dec], device=dev)


class BatchedLocalLayout(LocalLayout):
    name = "local"

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._batch: _DecodeBatch | None = None

    def _decode_batch(self, ctx: ForwardContext) -> _DecodeBatch:
        if self._ctx is not ctx:
            self._ctx, self._batch = ctx, _DecodeBatch(ctx)
        assert self._batch is not None
        return self._batch

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        self.write_kv(layer_idx, latent_new, ctx)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
        b = self._decode_batch(ctx)
        if not b.size:
            return self._per_slice(layer_idx, mla, q_lat, q_pe, ctx, ctx.seqs)
        d_c = q_lat.shape[-1]
        layer = ctx.kv.layer(layer_idx)  # [num_pages, P, D]
        D = layer.shape[-1]
        keys = layer.view(layer.shape[0], -1).index_select(0, b.pages).view(b.size, b.width, D)  # [B, M, D]
        q = torch.cat([q_lat, q_pe], dim=-1)
        if not b.all_rows:
            q = q[b.rows]
        # scale * (q . k) + mask in one kernel; [B, h, M]
        s = torch.baddbmm(b.bias, q, keys.transpose(1, 2), alpha=mla.softmax_scale)
        if s.dtype in (torch.bfloat16, torch.float16):
            s = s.float()
        p = torch.softmax(s, dim=-1).to(keys.dtype)
        o = torch.bmm(p, keys[..., :d_c])  # [B, h, d_c]
        if b.all_rows:
            return mla.out_heads(o)
        out = torch.empty_like(q_lat)
        out[b.rows] = o
        return mla.out_heads(self._per_slice(layer_idx, mla, q_lat, q_pe, ctx, b.others, out))

    def _per_slice(self, layer_idx: int, mla: MLA, q_lat: torch.Tensor, q_pe: torch.Tensor,
                   ctx: ForwardContext, seqs: list, out: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill chunks (or every slice when nothing decodes) through the shared kernel."""
        full = out is None
        if out is None:
            out = torch.empty_like(q_lat)
        for s in seqs:
            keys, pos = self.keys(layer_idx, s, ctx)
            r = s.rows
            out[r] = attend(q_lat[r], q_pe[r], keys, pos, ctx.positions[r], mla.softmax_scale)[0]
        return mla.out_heads(out) if full else out
