"""Command-line options of live layout switching, shared by `generate`, `serve` and the benchmarks."""

from __future__ import annotations

import argparse
from typing import Any

from splash.commands.argtypes import ranged
from splash.step.plan import LAYOUTS

_fraction = ranged(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
_count = ranged(int, lambda v: v >= 0, "a non-negative integer")


def add_switch_args(p: argparse.ArgumentParser, layout: bool = True) -> None:
    """--layout (with auto), --switch-schedule, --switch-mode, --theta, --switch-margin, --min-dwell-steps."""
    if layout:
        p.add_argument("--layout", default=None, choices=(*LAYOUTS, "auto"),
                       help="attention layout; auto (the default when T > 1) lets the layout policy switch "
                            "live, tp otherwise")
    p.add_argument("--switch-schedule", default=None, metavar="STEP:LAYOUT,...",
                   help="force live switches at these engine steps, e.g. '8:dp,20:cp' (T > 1)")
    p.add_argument("--switch-mode", default="overlapped", choices=("overlapped", "blocking"),
                   help="overlapped (default): layer i+1's state moves while layer i computes; blocking: "
                        "all transfers first (for comparison)")
    p.add_argument("--theta", default=None, metavar="FILE|PROFILE",
                   help="the prior --layout auto starts from: a calibrated theta (`splash calibrate --out "
                        "FILE`) or a hardware profile (cpu, h200, b200, dcu); default: the device's built-in "
                        "prior. Either way auto corrects it online from the engine's own step times")
    p.add_argument("--switch-margin", type=_fraction, default=0.05,
                   help="auto: switch when another feasible layout is predicted this fraction faster "
                        "(default 0.05)")
    p.add_argument("--min-dwell-steps", type=_count, default=8,
                   help="auto: steps to stay in a layout before a voluntary switch (default 8)")


def switch_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """build_engine keywords from the options above (missing ones fall back to the defaults)."""
    out = {"switch_schedule": getattr(args, "switch_schedule", None),
           "switch_mode": getattr(args, "switch_mode", "overlapped"), "theta": getattr(args, "theta", None),
           "switch_margin": getattr(args, "switch_margin", 0.05),
           "min_dwell_steps": getattr(args, "min_dwell_steps", 8)}
    return out
