"""Layout name -> Layout class: the four multi-rank layouts (and the T = 1 one) behind one interface."""

from __future__ import annotations

from splash.attention.base import Layout
from splash.attention.cp import CPLayout
from splash.attention.dop import DOPLayout
from splash.attention.dp import DPLayout
from splash.attention.local import LocalLayout
from splash.attention.tp import TPLayout

LAYOUT_CLASSES: dict[str, type[Layout]] = {
    "tp": TPLayout,
    "dp": DPLayout,
    "cp": CPLayout,
    "dop": DOPLayout,
    "local": LocalLayout,
}
NAMES = ("tp", "dp", "cp", "dop")  # what --layout accepts


def layout_class(name: str) -> type[Layout]:
    """The class for a layout name; ValueError (one line, with the choices) for an unknown one."""
    key = str(name).lower().strip()
    if key not in LAYOUT_CLASSES:
        raise ValueError(f"unknown attention layout {name!r}; choose one of {', '.join(NAMES)}")
    return LAYOUT_CLASSES[key]


def make_layout(name: str) -> Layout:
    """A fresh layout instance (each keeps small per-step caches, so one per engine/rank)."""
    return layout_class(name)()
