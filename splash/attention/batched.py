"""Batched attention over a step's slices: one page gather + two batched matmuls per group and layer.

Attending slice by slice costs ~10 small ops per request per layer; in a decode step (one row per
request) that Python/dispatch overhead dominates on CPU, and a rank that attends twice the requests
(TP against DP) pays it twice. Here the slices a rank attends are grouped by their number of new rows
and, inside that, by context length (sorted, a new group whenever the longest context would exceed
twice the group's shortest, so padding at most doubles the keys), and each group is attended at once:
its keys are the whole pages of its padded page tables (only the pages this rank holds: CP's shard of
every T-th page), masked by position. Groups are also cut so their [B, L*h, M] scores stay under
`_MAX_SCORES`. Groups, tables and masks depend only on the step, so they are built once per step (first
layer) and reused by every layer. The result equals the per-slice kernel (`kernel.attend`) to rounding.
"""

from __future__ import annotations

import torch

from splash.attention.kernel import acc_dtype
from splash.model.context import ForwardContext, SliceCtx

_MAX_SCORES = 1 << 24  # elements of one group's [B, L*h, M] scores (a lone slice may exceed it)
_MAX_BIAS = 1 << 22  # elements up to which a chunk group's mask is expanded over the heads (fused add)
_MAX_PAD = 2  # a group's longest context is at most this many times its shortest


class _Group:
    """B slices of L new rows each: query rows (in the caller's order) [B*L], page table [B, W] and
    additive mask [B, L*h or 1, W*P].

    Keys are gathered by whole pages (W per slice, from the context's padded table), so the per-layer
    gather copies B*W contiguous blocks rather than B*W*P single rows."""

    def __init__(self, ctx: ForwardContext, idx: list[int], local: list[int], heads: int,
                 whole: bool) -> None:
        seqs = ctx.seqs
        dev = ctx.positions.device
        members = [seqs[k] for k in idx]
        self.size, self.q_len = len(members), members[0].num_new
        P = ctx.page_size
        width = -(-max(s.end for s in members) // P)
        table = ctx.page_table
        if table is None:  # a context built by hand: tables from the plan's lists
            lists = [s.all_pages[ctx.rank] if s.all_pages else s.pages.tolist() for s in members]
            table = torch.tensor([t[:width] + [-1] * (width - len(t)) for t in lists], dtype=torch.long,
                                 device=dev)
        elif whole:
            table = table[:, :width]
        else:
            table = table[torch.tensor(idx, device=dev), :width]
        self.holes = not ctx.all_held
        key_pos = torch.arange(width * P, device=dev)  # position of each gathered key
        held = None
        if self.holes:  # keep only the pages this rank holds (CP: every T-th page), in position order
            held = table >= 0
            order = torch.argsort((~held).to(torch.int8), dim=1, stable=True)
            width = max(int(held.sum(dim=1).max()), 1)
            order = order[:, :width]
            table, held = table.gather(1, order), held.gather(1, order)
            key_pos = (order[:, :, None] * P + torch.arange(P, device=dev)).view(len(members), width * P)
        self.width = width * P
        self.pages = table.clamp(min=0).reshape(-1)  # flat, for index_select of whole pages
        # `whole`: the group is every slice, in order, and the caller's rows are the step's rows.
        self.whole = whole
        if self.q_len == 1:
            self.rows = None if whole else torch.tensor(local, device=dev)
            q_pos = torch.tensor([s.start for s in members], device=dev)[:, None]  # [B, 1]
        else:
            steps = torch.arange(self.q_len, device=dev)
            self.rows = None if whole else (torch.tensor(local, device=dev)[:, None] + steps).view(-1)
            q_pos = ctx.positions[torch.tensor([s.row_start for s in members], device=dev)[:, None] + steps]
        # Causal by position: row at position p sees keys at positions <= p (so never the padding past
        # its slice's end), on pages this rank holds.
        ends = torch.tensor([s.end for s in members], device=dev)[:, None]
        exists = key_pos < ends  # [B, M]: a key of the slice (not page padding past its end) ...
        if held is None:
            visible = key_pos <= q_pos[:, :, None]  # [B, L, M]
        else:
            mine = held.repeat_interleave(P, dim=1)  # ... on a page this rank holds
            exists = exists & mine
            visible = (key_pos[:, None, :] <= q_pos[:, :, None]) & mine[:, None, :]
        # Slots that are not keys (padding, pages not held, the tail of the last page) may hold anything
        # a freed or reused page holds, NaN included; zeroed after the gather so the mask really masks.
        self.junk = None if bool(exists.all()) else ~exists[:, :, None]
        dtype = ctx.kv.dtype if ctx.kv is not None else torch.float32
        zero = torch.zeros((), dtype=dtype, device=dev)
        bias = torch.where(visible, zero, zero - float("inf"))  # additive mask: 0 visible, -inf not
        # [B, 1, M] for decode rows (broadcast over the heads by baddbmm). Chunks: [B, L*h, M], one row per
        # (query row, head) as the queries are laid out, fused into baddbmm while that copy is small;
        # else [B, L, 1, M], added to the scores viewed [B, L, h, M] (an expanded copy would be as large
        # as the scores and live for the whole step)
        B, L, M = bias.shape
        if self.q_len == 1:
            self.bias = bias
        elif B * L * heads * M <= _MAX_BIAS:
            self.bias = bias[:, :, None, :].expand(B, L, heads, M).reshape(B, L * heads, M)
        else:
            self.bias = bias[:, :, None, :]

    def attend(self, layer_idx: int, q: torch.Tensor, ctx: ForwardContext, scale: float, d_c: int,
               lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [B*L, h, d_c], lse [B*L, h] or None) of the group's rows; `q` [n, h, D] all rows."""
        h = q.shape[1]
        layer = ctx.kv.layer(layer_idx)  # [num_pages, P, row] (the stored rows: an FP8 cache's bytes)
        keys = layer.view(layer.shape[0], -1).index_select(0, self.pages).view(self.size, self.width, -1)
        keys = ctx.kv.decode(layer_idx, keys)  # (only the gathered pages are decoded)
        D = keys.shape[-1]
        if self.junk is not None:
            keys = keys.masked_fill_(self.junk, 0)
        if self.rows is not None:
            q = q[self.rows]
        q = q.reshape(self.size, self.q_len * h, D)
        if self.bias.dim() == 3:
            s = torch.baddbmm(self.bias, q, keys.transpose(1, 2), alpha=scale)  # scale * q.k + mask
        else:
            s = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)
            M = s.shape[-1]
            s = s.view(self.size, self.q_len, h, M).add_(self.bias).view(self.size, self.q_len * h, M)
        s = s.to(acc_dtype(s.dtype))
        total = torch.logsumexp(s, dim=-1).view(self.size * self.q_len, h) if lse else None
        p = torch.softmax(s, dim=-1).to(keys.dtype)
        o = torch.bmm(p, keys[..., :d_c]).view(self.size * self.q_len, h, d_c)
        # a row that sees no key (only when this rank lacks pages) gets 0, as from the kernel
        return (torch.nan_to_num(o, nan=0.0) if self.holes else o), total


class SliceBatches:
    """The batched groups of one step for the slices `idx` (positions in ctx.seqs, batch order), whose
    query rows the caller lays out slice after slice in that order."""

    def __init__(self, ctx: ForwardContext, idx: list[int], heads: int) -> None:
        seqs = ctx.seqs
        local, at = {}, 0
        for k in idx:
            local[k] = at
            at += seqs[k].num_new
        whole = len(idx) == len(seqs) and all(local[k] == seqs[k].row_start for k in idx)
        by_len: dict[int, list[int]] = {}
        for k in idx:
            by_len.setdefault(seqs[k].num_new, []).append(k)
        self.groups = []
        for n, ks in by_len.items():
            for part in _split(ks, seqs, n, heads):
                in_order = whole and len(part) == len(seqs)
                self.groups.append(_Group(ctx, part, [local[k] for k in part], heads, in_order))

    def attend(self, layer_idx: int, q_lat: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext,
               scale: float, lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [n, h, d_c], lse [n, h] or None) for the caller's rows q_lat [n, h, d_c], q_pe [n, h, d_r]."""
        n, h, d_c = q_lat.shape
        q = torch.cat([q_lat, q_pe], dim=-1)
        if len(self.groups) == 1 and self.groups[0].whole:
            return self.groups[0].attend(layer_idx, q, ctx, scale, d_c, lse)
        out = q_lat.new_empty(n, h, d_c)
        total = None
        if lse:
            total = torch.empty(n, h, dtype=acc_dtype(q_lat.dtype), device=q_lat.device)
        for g in self.groups:
            o, t = g.attend(layer_idx, q, ctx, scale, d_c, lse)
            rows = g.rows if g.rows is not None else slice(None)
            out[rows] = o
            if total is not None:
                total[rows] = t
        return out, total


def _split(ks: list[int], seqs: list[SliceCtx], q_len: int, heads: int) -> list[list[int]]:
    """Slices with `q_len` new rows, cut into groups: sorted by context, each group's longest context at
    most `_MAX_PAD` times its shortest, and its scores under `_MAX_SCORES` (kept in order if one group)."""
    order = sorted(ks, key=lambda k: seqs[k].end)
    page = seqs[ks[0]].page_size
    parts: list[list[int]] = []
    cur: list[int] = []
    for k in order:
        end = seqs[k].end
        if cur and (end > _MAX_PAD * max(seqs[cur[0]].end, 1)
                    or (len(cur) + 1) * q_len * heads * (-(-end // page) * page) > _MAX_SCORES):
            parts.append(cur)
            cur = []
        cur.append(k)
    if cur:
        parts.append(cur)
    if len(parts) == 1:
        return [ks]  # one group: keep batch order (the whole step then needs no row scatter)
    return parts


class BatchCache:
    """Per-step SliceBatches of a layout, built at the first layer and reused by the others."""

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._made: dict[tuple[str, int], SliceBatches] = {}

    def get(self, ctx: ForwardContext, key: str, idx: list[int] | None, heads: int) -> SliceBatches:
        """The batches for `idx` (None: every slice), cached per step under (key, heads)."""
        if self._ctx is not ctx:
            self._ctx, self._made = ctx, {}
        b = self._made.get((key, heads))
        if b is None:
            b = SliceBatches(ctx, list(range(len(ctx.seqs))) if idx is None else idx, heads)
            self._made[(key, heads)] = b
        return b

