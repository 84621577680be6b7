"""The user's switching options, resolved on rank 0 before any rank starts: `--layout` (a fixed layout
or `auto`) and `--switch-schedule "STEP:LAYOUT,..."` (forced switches). ConfigError names the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splash.core.config import ConfigError
from splash.step.plan import LAYOUTS

AUTO_START = "dop"  # where --layout auto starts: the most KV a budget allows, sharded projections


def parse_schedule(text: str | Sequence[tuple[int, str]] | None) -> list[tuple[int, str]]:
    """'8:dp,20:cp' -> [(8, 'dp'), (20, 'cp')] (sorted by step); ConfigError with the fix otherwise."""
    if text is None or text == "":
        return []
    if not isinstance(text, str):
        items = [(int(s), str(lay).lower()) for s, lay in text]
    else:
        items = []
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            step, sep, lay = part.partition(":")
            try:
                n = int(step)
            except ValueError:
                n = -1
            if not sep or n < 0:
                raise ConfigError(f"--switch-schedule: cannot read {part!r}; write STEP:LAYOUT pairs, e.g. "
                                  "'8:dp,20:cp' (STEP a non-negative engine step)")
            items.append((n, lay.lower()))
    for n, lay in items:
        if lay not in LAYOUTS:
            raise ConfigError(f"--switch-schedule: unknown layout {lay!r} at step {n}; choose one of "
                              f"{', '.join(LAYOUTS)}")
    steps = [n for n, _ in items]
    if len(set(steps)) != len(steps):
        raise ConfigError("--switch-schedule: a step appears twice; one switch per step")
    return sorted(items)


def resolve_layout(layout: str | None, world: int, schedule: Any) -> tuple[str, bool, list[tuple[int, str]]]:
    """(layout to load, auto?, forced schedule) from the user's options; ConfigError on bad input."""
    sched = parse_schedule(schedule)
    if layout is None:
        layout = "auto" if world > 1 else "tp"
    layout = str(layout).lower()
    if layout != "auto" and layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose auto or one of {', '.join(LAYOUTS)}")
    if world == 1:
        if sched:
            raise ConfigError("--switch-schedule needs T > 1 ranks (one rank has one layout); add --tp 2")
        return ("tp" if layout == "auto" else layout), False, []
    if layout == "auto":
        return AUTO_START, True, sched
    return layout, False, sched
