"""`splash demo`: the guided tour that `make demo` runs (see splash/demo.py)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the guided demo (what `make demo` runs)")
    p.add_argument("--stages", default=None, help="comma-separated subset of the demo's stages")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from splash.demo import main

    return main(["--stages", args.stages] if args.stages else [])
