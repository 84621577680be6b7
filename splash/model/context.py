"""ForwardContext: what one rank's layers need to run one step (see docs/runtime.md).

Built once per step from the plan's slices. Everything layer-independent is precomputed here and
shared by every layer: row ranges, this rank's page table per slice, the pool slots new tokens are
written to on this rank, and (lazily) the slots and positions of the keys this rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from splash.attention.base import Layout
    from splash.engine.plan import SeqSlice
    from splash.kv.pool import KVPool


@dataclass
class SliceCtx:
    """One request's rows in this step, with tensors on the model's device."""

    req_id: int
    start: int
    num_new: int
    owner: int
    sample: bool
    row_start: int
    pages: torch.Tensor  # this rank's table: local page id of each global page, -1 where not held
    all_pages: list[list[int]]  # every rank's table (as planned), for layouts that need them
    page_size: int
    _keys: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_new)

    def key_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat pool slots, positions) of this slice's keys held on this rank, up to `end`."""
        if self._keys is None:
            from splash.attention.kernel import key_slots

            self._keys = key_slots(self.pages, self.end, self.page_size)
        return self._keys


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [N] absolute position of every row
    seqs: list[SliceCtx]
    kv: KVPool | None
    layout: Layout
    comm: Any = None
    rank: int = 0
    world: int = 1
    stats: dict[str, Any] = field(default_factory=dict)
    write_rows: torch.Tensor | None = None  # rows whose latent this rank stores ...
    write_slots: torch.Tensor | None = None  # ... and where (flat index into pool.layer(i).view(-1, D))

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(cls, seqs: Sequence[SeqSlice], *, kv: KVPool | None, layout: Layout, comm: Any = None,
              rank: int = 0, world: int = 1, page_size: int | None = None,
              device: torch.device | str | None = None, stats: dict[str, Any] | None = None
              ) -> ForwardContext:
        """From a StepPlan's slices (in plan order). `page_size` defaults to the pool's."""
        if page_size is None:
            if kv is None:
                raise ValueError("ForwardContext.build needs page_size when there is no KV pool")
            page_size = kv.page_size
        if device is not None:
            dev = torch.device(device)
        else:
            dev = kv.device if kv is not None else torch.device("cpu")
        P = page_size
        out: list[SliceCtx] = []
        positions: list[torch.Tensor] = []
        w_rows: list[torch.Tensor] = []
        w_slots: list[torch.Tensor] = []
        row = 0
        for s in seqs:
            table = torch.tensor(s.pages[rank], dtype=torch.long)
            out.append(SliceCtx(req_id=s.req_id, start=s.start, num_new=s.num_new, owner=s.owner,
                                sample=s.sample, row_start=row, all_pages=s.pages, page_size=P,
                                pages=table.to(dev)))
            pos = torch.arange(s.start, s.start + s.num_new)
            local = table[pos // P]
            held = local >= 0
            positions.append(pos)
            w_rows.append(torch.arange(row, row + s.num_new)[held])
            w_slots.append((local * P + pos % P)[held])
            row += s.num_new

        def cat(v: list[torch.Tensor]) -> torch.Tensor:
            return (torch.cat(v) if v else torch.zeros(0, dtype=torch.long)).to(dev)

        return cls(positions=cat(positions), seqs=out, kv=kv, layout=layout, comm=comm, rank=rank,
                   world=world, stats=stats if stats is not None else {}, write_rows=cat(w_rows),
                   write_slots=cat(w_slots))
