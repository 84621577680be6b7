"""The attention layouts' table: which class attends in each of the analytical core's layouts.

| layout | projections: heads per rank | request's KV | page j of it lives on | pools count   | class     |
|--------|-----------------------------|--------------|-----------------------|---------------|-----------|
| TP     | sharded: rank r's 1/T slice | replicated   | every rank            | smallest rank | TPLayout  |
| DP     | replicated: all heads       | one owner    | the owner             | sum of ranks  | DPLayout  |
| CP     | replicated: all heads       | by position  | rank j % T            | sum of ranks  | CPLayout  |
| DOP    | sharded: rank r's 1/T slice | one owner    | the owner             | sum of ranks  | DOPLayout |

Every fact of a layout (heads per rank, page placement, owners, how pools count) is the core's
(`splash.core.layouts.Layout`, each rule written once there) and the runtime asks the core for it
(`Layout.named(name)`); this table only adds the class that attends in it. Nothing outside this module
imports an attention implementation to read a fact.

Adding a fifth layout: its member in the core's `Layout` (a placement and an ownership; the core's
cost model, splash/core/costmodel.py, must also learn to price it), one entry here, and one attention
file (a subclass of `AttentionLayout` whose `core` is that member).
"""

from __future__ import annotations

from splash.attention.base import AttentionLayout
from splash.attention.cp import CPLayout
from splash.attention.dop import DOPLayout
from splash.attention.dp import DPLayout
from splash.attention.kernels import Kernels
from splash.attention.local import LocalLayout
from splash.attention.tp import TPLayout
from splash.core.layouts import LAYOUTS, Layout

CLASSES: dict[Layout, type[AttentionLayout]] = {
    Layout.TP: TPLayout,
    Layout.DP: DPLayout,
    Layout.CP: CPLayout,
    Layout.DOP: DOPLayout,
}
assert tuple(CLASSES) == LAYOUTS, "one class per core layout, in the core's order"
assert all(cls.core is lay for lay, cls in CLASSES.items())
NAMES = tuple(lay.value for lay in CLASSES)  # what --layout accepts
LAYOUT_CLASSES: dict[str, type[AttentionLayout]] = {**{lay.value: c for lay, c in CLASSES.items()},
                                                   "local": LocalLayout}


def layout_class(name: str) -> type[AttentionLayout]:
    """The class for a layout name; ValueError (one line, with the choices) for an unknown one."""
    key = str(name).lower().strip()
    if key not in LAYOUT_CLASSES:
        raise ValueError(f"unknown attention layout {name!r}; choose one of {', '.join(NAMES)}")
    return LAYOUT_CLASSES[key]


def make_layout(name: str, kernels: Kernels | None = None) -> AttentionLayout:
    """A fresh layout instance (each keeps small per-step caches, so one per engine/rank) attending with
    `kernels` (the rank's one `Kernels`, built from the engine's KernelConfig: every layout of a rank,
    a live switch's too, shares it; default: a Kernels of its own with auto forms, fast kernels)."""
    return layout_class(name)(kernels)
