"""The single-rank layout with slices batched: one gather + two batched matmuls per group and layer.

`LocalLayout` attends slice by slice, which costs ~10 small ops per request per layer; in a decode
step (one row per request) that Python/dispatch overhead dominates, and so it does when a step
prefills many prompts at once. Here the step's slices are grouped by their number of new rows: every
group of two or more (all the decodes; prompts prefilled in equal chunks) is attended together, its
keys padded to the group's longest context and masked by position; the rest go through the shared
kernel one by one. The groups, padded page tables and masks depend only on the step, so they are built
once per step (first layer) and reused by every layer.
"""

from __future__ import annotations

import torch

from splash.attention.kernel import attend
from splash.attention.local import LocalLayout
from splash.model.context import ForwardContext, SliceCtx
from splash.model.mla import MLA


class _Group:
    """B slices of L new rows each: rows [B*L], page table [B, W], additive mask [B, L*h, W*P].

    Keys are gathered by whole pages (W per slice, from the context's padded table), so the per-layer
    gather copies B*W contiguous blocks rather than B*W*P single rows."""

    def __init__(self, ctx: ForwardContext, idx: list[int], heads: int) -> None:
        seqs = ctx.seqs
        dev = ctx.positions.device
        members = [seqs[k] for k in idx]
        self.size, self.q_len = len(members), members[0].num_new
        P = members[0].page_size
        width = -(-max(s.end for s in members) // P)
        table = ctx.page_table
        if table is None:  # a context built by hand: tables from the plan's lists
            lists = [s.all_pages[ctx.rank] for s in members]
            table = torch.tensor([t[:width] + [-1] * (width - len(t)) for t in lists], dtype=torch.long,
                                 device=dev)
        elif len(idx) == len(seqs):
            table = table[:, :width]
        else:
            table = table[torch.tensor(idx, device=dev), :width]
        self.width = width * P
        self.pages = table.clamp(min=0).reshape(-1)  # flat, for index_select of whole pages
        # Rows in slice order; when the group is the whole step they are simply all rows in order.
        self.whole = len(idx) == len(seqs)
        starts = [s.row_start for s in members]
        if self.q_len == 1:
            self.rows = None if self.whole else torch.tensor(starts, device=dev)
            q_pos = torch.tensor([s.start for s in members], device=dev)[:, None]  # [B, 1]
        else:
            r = torch.tensor(starts, device=dev)[:, None] + torch.arange(self.q_len, device=dev)
            self.rows = None if self.whole else r.view(-1)
            q_pos = ctx.positions[r]  # [B, L]
        # Causal by position: row at position p sees keys at positions <= p (so never the padding past
        # its slice's end), on pages this rank holds.
        visible = torch.arange(self.width, device=dev) <= q_pos[:, :, None]  # [B, L, M]
        if not ctx.all_held:
            visible &= (table >= 0).repeat_interleave(P, dim=1)[:, None, :]
        dtype = ctx.kv.dtype if ctx.kv is not None else torch.float32
        zero = torch.zeros((), dtype=dtype, device=dev)
        bias = torch.where(visible, zero, zero - float("inf"))  # additive mask: 0 visible, -inf not
        if self.q_len == 1:
            self.bias = bias  # [B, 1, M], broadcast over the heads
        else:  # [B, L*h, M]: one row per (query row, head), as the queries are laid out
            B, L, M = bias.shape
            self.bias = bias[:, :, None, :].expand(B, L, heads, M).reshape(B, L * heads, M)


class _StepGroups:
    """The step's batched groups and the slices left to the per-slice kernel."""

    def __init__(self, ctx: ForwardContext, heads: int) -> None:
        by_len: dict[int, list[int]] = {}
        for k, s in enumerate(ctx.seqs):
            by_len.setdefault(s.num_new, []).append(k)
        self.groups: list[_Group] = []
        self.others: list[SliceCtx] = []
        for n, idx in by_len.items():
            if n == 1 or (len(idx) > 1 and self._fits(ctx, idx, heads)):
                self.groups.append(_Group(ctx, idx, heads))
            else:
                self.others.extend(ctx.seqs[k] for k in idx)
        self.heads = heads

    @staticmethod
    def _fits(ctx: ForwardContext, idx: list[int], heads: int) -> bool:
        """Batch prefill chunks only while the padded scores stay small (the per-slice kernel's own
        scores are as large per slice; padding and the batch must not blow them up)."""
        seqs = ctx.seqs
        return len(idx) * seqs[idx[0]].num_new * heads * max(seqs[k].end for k in idx) <= _MAX_SCORES


_MAX_SCORES = 1 << 24  # elements of one prefill group's [B, L*h, M] scores


class BatchedLocalLayout(LocalLayout):
    name = "local"

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._groups: _StepGroups | None = None

    def _step_groups(self, ctx: ForwardContext, heads: int) -> _StepGroups:
        if self._ctx is not ctx or self._groups is None or self._groups.heads != heads:
            self._ctx, self._groups = ctx, _StepGroups(ctx, heads)
        return self._groups

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        self.write_kv(layer_idx, latent_new, ctx)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
        st = self._step_groups(ctx, q_lat.shape[1])
        if len(st.groups) == 1 and st.groups[0].whole:  # the whole step is one group: no scatter
            return mla.out_heads(self._attend_group(st.groups[0], layer_idx, mla, q_lat, q_pe, ctx))
        out = torch.empty_like(q_lat)
        for g in st.groups:
            out[g.rows] = self._attend_group(g, layer_idx, mla, q_lat, q_pe, ctx)
        for s in st.others:
            keys, pos = self.keys(layer_idx, s, ctx)
            r = s.rows
            out[r] = attend(q_lat[r], q_pe[r], keys, pos, ctx.positions[r], mla.softmax_scale, lse=False)[0]
        return mla.out_heads(out)

    @staticmethod
    def _attend_group(g: _Group, layer_idx: int, mla: MLA, q_lat: torch.Tensor, q_pe: torch.Tensor,
                      ctx: ForwardContext) -> torch.Tensor:
        """[B*L, h, d_c] attention output of a group's rows (in group order)."""
        n, h, d_c = q_lat.shape
        layer = ctx.kv.layer(layer_idx)  # [num_pages, P, D]
        D = layer.shape[-1]
        keys = layer.view(layer.shape[0], -1).index_select(0, g.pages).view(g.size, g.width, D)  # [B, M, D]
        q = torch.cat([q_lat, q_pe], dim=-1)  # [N, h, D]
        if g.rows is not None:
            q = q[g.rows]
        q = q.view(g.size, g.q_len * h, D)
        # scale * (q . k) + mask in one kernel; [B, L*h, M]
        s = torch.baddbmm(g.bias, q, keys.transpose(1, 2), alpha=mla.softmax_scale)
        if s.dtype in (torch.bfloat16, torch.float16):
            s = s.float()
        p = torch.softmax(s, dim=-1).to(keys.dtype)
        o = torch.bmm(p, keys[..., :d_c]).view(g.size * g.q_len, h, d_c)
        # a row that sees no key (only when this rank lacks pages) gets 0, as from the kernel
        return o if ctx.all_held else torch.nan_to_num(o, nan=0.0)
