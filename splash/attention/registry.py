"""The runtime's layout table: one row per attention layout, keyed by the analytical core's `Layout`.

| layout | projections: heads per rank | request's KV | page j of it lives on | pools count   | class     |
|--------|-----------------------------|--------------|-----------------------|---------------|-----------|
| TP     | sharded: rank r's 1/T slice | replicated   | every rank            | smallest rank | TPLayout  |
| DP     | replicated: all heads       | one owner    | the owner             | sum of ranks  | DPLayout  |
| CP     | replicated: all heads       | by position  | rank j % T            | sum of ranks  | CPLayout  |
| DOP    | sharded: rank r's 1/T slice | one owner    | the owner             | sum of ranks  | DOPLayout |

A row is the core's layout (splash/core/layouts.py: projection placement x KV ownership, from which heads
per rank, page placement and how per-rank pools count are derived, each written once there) plus the
attention class that runs it. Every runtime question about a layout is asked of its row (`row(name)`):
the allocator's placement rule, which requests have owners, which layouts hold projection replicas,
the heads a rank holds, how many distinct tokens the pools hold. No runtime module tests layout names.

Adding a fifth layout: its member in the core's `Layout` (a placement and an ownership; the core's
cost model, splash/core/costmodel.py, must also learn to price it), one row here, and one attention
file (a subclass of `AttentionLayout` whose `core` is that member). Nothing else in the runtime
changes: every other module asks the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splash.attention.base import AttentionLayout
from splash.attention.cp import CPLayout
from splash.attention.dop import DOPLayout
from splash.attention.dp import DPLayout
from splash.attention.local import LocalLayout
from splash.attention.tp import TPLayout
from splash.core.layouts import LAYOUTS, Layout, Ownership


@dataclass(frozen=True)
class LayoutRow:
    """One layout as the runtime sees it: the core's layout and the class that attends in it."""

    core: Layout
    attention: type[AttentionLayout]

    @property
    def name(self) -> str:
        """The runtime's name ("tp", ...): plans, allocators, flags and logs use it."""
        return self.core.value

    @property
    def shards_projections(self) -> bool:
        """Each rank holds its 1/T head slice of Q-B, KV-B and O (else every rank holds them all)."""
        return self.core.sharded

    @property
    def owned(self) -> bool:
        """Each request lives on one owner rank, chosen at admission (or by a switch)."""
        return self.core.owned

    @property
    def ownership(self) -> Ownership:
        return self.core.ownership

    def heads(self, rank: int, world: int, heads: int) -> range:
        """The heads rank `rank` of `world` holds."""
        return self.core.heads(rank, world, heads)

    def page_ranks(self, j: int, owner: int, world: int) -> tuple[int, ...]:
        """Ranks that store global page `j` of a request owned by `owner`."""
        return self.core.page_ranks(j, owner, world)

    def distinct(self, per_rank: Sequence[int]) -> int:
        """Distinct KV (tokens or pages) the group holds given each rank's pool."""
        return self.core.distinct(per_rank)


ROWS: dict[Layout, LayoutRow] = {row.core: row for row in (
    LayoutRow(Layout.TP, TPLayout),
    LayoutRow(Layout.DP, DPLayout),
    LayoutRow(Layout.CP, CPLayout),
    LayoutRow(Layout.DOP, DOPLayout),
)}
assert tuple(ROWS) == LAYOUTS, "one row per core layout, in the core's order"
NAMES = tuple(r.name for r in ROWS.values())  # what --layout accepts
_BY_NAME = {r.name: r for r in ROWS.values()}
LAYOUT_CLASSES: dict[str, type[AttentionLayout]] = {**{r.name: r.attention for r in ROWS.values()},
                                                   "local": LocalLayout}


def row(layout: str | Layout) -> LayoutRow:
    """The row of a runtime layout name ("tp", exactly as plans carry it) or core layout; ValueError
    (one line, with the choices) for anything else."""
    if isinstance(layout, Layout):
        return ROWS[layout]
    found = _BY_NAME.get(layout)  # type: ignore[arg-type]
    if found is None:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(NAMES)}")
    return found


def layout_class(name: str) -> type[AttentionLayout]:
    """The class for a layout name; ValueError (one line, with the choices) for an unknown one."""
    key = str(name).lower().strip()
    if key not in LAYOUT_CLASSES:
        raise ValueError(f"unknown attention layout {name!r}; choose one of {', '.join(NAMES)}")
    return LAYOUT_CLASSES[key]


def make_layout(name: str) -> AttentionLayout:
    """A fresh layout instance (each keeps small per-step caches, so one per engine/rank)."""
    return layout_class(name)()
