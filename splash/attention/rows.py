"""Who computes which rows of a step: rows grouped by owner rank, and the head check every layout runs.

Kept apart from the layouts (and from `base.py`) so the base class's KDA dispatch and every layout
can ask it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from splash.core.layouts import Layout
from splash.model.context import ForwardContext


class LayoutFacts(Protocol):
    """What the head check reads of a layout (an `AttentionLayout`)."""

    name: str
    core: Layout | None
    shards_projections: bool


class HeadHolder(Protocol):
    """An attention module holding a slice of a layer's heads (MLA, KDA)."""

    heads: range
    total_heads: int


def check_heads(mla: HeadHolder, ctx: ForwardContext, layout: LayoutFacts) -> None:
    """Refuse a layer holding the wrong heads for this layout (a switch left half done, or a bug)."""
    world, rank, core = ctx.world, ctx.rank, layout.core
    want = core.heads(rank, world, mla.total_heads) if core is not None else range(mla.total_heads)
    if mla.heads != want:
        raise RuntimeError(f"{layout.name}: rank {rank} of {world} must hold heads {want}, its layer holds "
                           f"{mla.heads}; build the model with attn_sharded={layout.shards_projections} or "
                           "switch first")


@dataclass
class OwnerRows:
    """Rows of a step grouped by owner rank (batch order kept inside each group)."""

    counts: list[int]          # counts[r] = rows owned by rank r
    order: torch.Tensor        # [N] row ids, owner 0's rows first, then owner 1's, ...
    mine: list[int]            # this rank's slices (positions in ctx.seqs), batch order
    mine_rows: torch.Tensor    # [counts[rank]] row ids of this rank's slices

    @classmethod
    def of(cls, ctx: ForwardContext, idx: list[int] | None = None) -> OwnerRows:
        """Of the slices `idx` (positions in ctx.seqs, batch order; None: all)."""
        world = ctx.world
        groups: list[list[int]] = [[] for _ in range(world)]
        ks = range(len(ctx.seqs)) if idx is None else idx
        for s in (ctx.seqs[k] for k in ks):
            if not 0 <= s.owner < world:
                raise ValueError(f"request {s.req_id}: owner rank {s.owner} outside 0..{world - 1}")
            groups[s.owner].extend(range(s.row_start, s.row_start + s.num_new))
        dev = ctx.positions.device

        def lt(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.long, device=dev)

        mine = [k for k in ks if ctx.seqs[k].owner == ctx.rank]
        return cls(counts=[len(g) for g in groups], order=lt([i for g in groups for i in g]), mine=mine,
                   mine_rows=lt(groups[ctx.rank]))


class OwnerRowsCache:
    """Per-step OwnerRows, computed at the first layer and reused by the others."""

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._rows: OwnerRows | None = None

    def get(self, ctx: ForwardContext, idx: list[int] | None = None) -> OwnerRows:
        if self._ctx is not ctx or self._rows is None:
            self._ctx, self._rows = ctx, OwnerRows.of(ctx, idx)
        return self._rows
