"""`splash bench <kind>`: each kind lives in `splash/bench/<kind>.py` with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = ("offline", "serve", "sweep", "switch", "rollout", "soak")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: offline, serve, sweep, switch, rollout, soak")
    kinds = p.add_subparsers(dest="bench_kind", metavar="KIND")
    for name in BENCH_MODULES:
        try:
            mod = importlib.import_module(f"splash.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"splash.bench.{name}":
                continue
            raise
        mod.register(kinds)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
