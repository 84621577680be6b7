"""The step context's builder: once per step on every rank, from the plan's slices (rank 0's own
plans, or the rank's stored tables), the model's `ForwardContext` (splash/model/context.py).

Everything layer-independent is precomputed here and shared by every layer. The build is a fixed
handful of tensor ops whatever the batch size: the plan's page tables become one padded [B, W] tensor
(`page_table`) and positions / write slots are computed over all rows at once; a slice's own `pages`
is a view of its row, made only if a layout asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splash.model.context import ForwardContext, SliceCtx, to_device

if TYPE_CHECKING:
    from splash.kv.pool import KVPool
    from splash.kv.state import StatePool
    from splash.step.plan import SeqSlice
    from splash.step.tables import RankTables


def build_context(seqs: Sequence[SeqSlice], *, kv: KVPool | None, layout: Any, comm: Any = None,
                  rank: int = 0, world: int = 1, page_size: int | None = None,
                  device: torch.device | str | None = None, stats: dict[str, Any] | None = None,
                  tables: RankTables | None = None, state: StatePool | None = None) -> ForwardContext:
    """From a StepPlan's slices (in plan order). `page_size` defaults to the pool's. With `tables`
    (the rank's own, kept from the step messages) the slices' `pages` are not read. With `state`
    (a KDA model's StatePool) the slices' `slot`s are read and fresh slots zeroed (`ctx.state`)."""
    ctx = _build(seqs, kv=kv, layout=layout, comm=comm, rank=rank, world=world, page_size=page_size,
                 device=device, stats=stats, tables=tables)
    if state is not None:
        ctx.state = state.step(ctx.seqs, ctx.positions.device)
    return ctx

def _build(seqs: Sequence[SeqSlice], *, kv: KVPool | None, layout: Any, comm: Any,
           rank: int, world: int, page_size: int | None, device: torch.device | str | None,
           stats: dict[str, Any] | None, tables: RankTables | None) -> ForwardContext:
    if page_size is None:
        if kv is None:
            raise ValueError("build_context needs page_size when there is no KV pool")
        page_size = kv.page_size
    if device is not None:
        dev = torch.device(device)
    else:
        dev = kv.device if kv is not None else torch.device("cpu")
    P = page_size
    if tables is not None:
        return _from_tables(seqs, tables, kv=kv, layout=layout, comm=comm, rank=rank, world=world,
                                P=P, dev=dev, stats=stats)
    lists = [s.pages[rank] for s in seqs]
    width = max(map(len, lists), default=0)
    padded = [t + [-1] * (width - len(t)) for t in lists]
    host = torch.tensor(padded, dtype=torch.long).view(len(lists), width)
    table = to_device(host, dev)
    out: list[SliceCtx] = []
    row = 0
    for k, s in enumerate(seqs):
        out.append(SliceCtx(s.req_id, s.start, s.num_new, s.owner, s.sample, row, None, s.pages, P,
                            table=(table, k, len(lists[k])), slot=s.slot))
        row += s.num_new
    holes = any(t and min(t) < 0 for t in lists)  # pages some slice has but this rank does not hold
    if row <= _PY_ROWS:
        pos, w_rows, w_slots = _rows_py(seqs, lists, P, holes)
    else:
        pos, w_rows, w_slots = _rows_torch(seqs, host, row, P)
    return ForwardContext(positions=to_device(pos, dev), seqs=out, kv=kv, layout=layout, comm=comm, rank=rank,
               world=world, stats=stats if stats is not None else {}, write_rows=to_device(w_rows, dev),
               write_slots=to_device(w_slots, dev), page_table=table,
               max_end=max((s.start + s.num_new for s in seqs), default=0), page_size=P,
               all_held=not holes)


def _from_tables(seqs: Sequence[SeqSlice], tables: RankTables, *, kv: KVPool | None,
                 layout: Any, comm: Any, rank: int, world: int, P: int, dev: torch.device,
                 stats: dict[str, Any] | None) -> ForwardContext:
    """`build` from the rank's stored tables: one gather of the slices' rows, numpy over the rows."""
    B = len(seqs)
    ids = [s.req_id for s in seqs]
    starts = [s.start for s in seqs]
    nums = [s.num_new for s in seqs]
    st = np.asarray(starts, dtype=np.int64)
    nu = np.asarray(nums, dtype=np.int64)
    need = (st + nu + (P - 1)) // P  # pages each slice's table covers after the step
    width = int(need.max()) if B else 0
    host, have = tables.gather(ids, width)
    if (have < need).any():
        k = int(np.flatnonzero(have < need)[0])
        raise RuntimeError(f"rank {rank}: request {ids[k]} has {int(have[k])} pages here but its step "
                           f"needs {int(need[k])} (a step message was lost or applied out of order)")
    if (have != need).any():  # longer than this step reaches: hide the rest, as a plan's table would
        host = np.where(np.arange(width)[None, :] < need[:, None], host, -1)
    holes = bool(((host >= 0).sum(axis=1) < need).any())
    table = to_device(torch.from_numpy(host), dev)
    out: list[SliceCtx] = []
    row = 0
    for k, (s, n) in enumerate(zip(seqs, need.tolist())):
        out.append(SliceCtx(s.req_id, s.start, s.num_new, s.owner, s.sample, row, None, None, P,
                            table=(table, k, n), slot=s.slot))
        row += s.num_new
    pos, w_rows, w_slots = _rows_np(st, nu, host, row, P)
    return ForwardContext(positions=to_device(torch.from_numpy(pos), dev), seqs=out, kv=kv, layout=layout,
                          comm=comm, rank=rank, world=world, stats=stats if stats is not None else {},
               write_rows=to_device(torch.from_numpy(w_rows), dev),
               write_slots=to_device(torch.from_numpy(w_slots), dev),
               page_table=table, max_end=int((st + nu).max()) if B else 0, page_size=P,
               all_held=not holes)


def _rows_np(starts: np.ndarray, nums: np.ndarray, host: np.ndarray, rows: int, P: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, write rows, write slots) of all rows from the [B, W] table, in numpy (int64)."""
    B = len(starts)
    if rows == B:  # one row per slice (decode)
        pos = starts
        local = host[np.arange(B), pos // P] if B else np.zeros(0, np.int64)
    else:
        seg = np.repeat(np.arange(B), nums)
        first = np.cumsum(nums) - nums
        pos = np.arange(rows) + (starts - first)[seg]
        local = host[seg, pos // P]
    slots = local * P + pos % P
    held = local >= 0
    if held.all():
        return pos, np.arange(rows), slots
    w_rows = np.flatnonzero(held)
    return pos, w_rows, slots[w_rows]


_PY_ROWS = 128  # up to this many rows, plain Python lists beat a dozen tiny tensor ops


def _rows_py(seqs: Sequence[SeqSlice], lists: list[list[int]], P: int, holes: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, write rows, write slots) of a small step, from the plan's lists."""
    pos: list[int] = []
    for s in seqs:
        pos.extend(range(s.start, s.start + s.num_new))
    slots: list[int] = []
    for s, t in zip(seqs, lists):
        slots.extend(t[p // P] * P + p % P for p in range(s.start, s.start + s.num_new))
    if not holes:
        return (torch.tensor(pos, dtype=torch.long), torch.arange(len(pos)),
                torch.tensor(slots, dtype=torch.long))
    rows, kept, r = [], [], 0
    for s, t in zip(seqs, lists):
        for p in range(s.start, s.start + s.num_new):
            if t[p // P] >= 0:
                rows.append(r)
                kept.append(t[p // P] * P + p % P)
            r += 1
    return (torch.tensor(pos, dtype=torch.long), torch.tensor(rows, dtype=torch.long),
            torch.tensor(kept, dtype=torch.long))


def _rows_torch(seqs: Sequence[SeqSlice], host: torch.Tensor, row: int, P: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same over all rows at once with tensor ops (long prefills), on the host."""
    starts = torch.tensor([s.start for s in seqs], dtype=torch.long)
    nums = torch.tensor([s.num_new for s in seqs], dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(len(seqs)), nums, output_size=row)
    first = torch.cumsum(nums, 0) - nums  # first row of each slice
    pos = torch.arange(row) + (starts - first).index_select(0, seg)
    local = host[seg, pos // P]
    slots = local * P + pos % P
    held = local >= 0
    if bool(held.all()):
        return pos, torch.arange(row), slots
    w_rows = held.nonzero().view(-1)
    return pos, w_rows, slots.index_select(0, w_rows)
