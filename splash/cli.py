"""`splash` command line: a thin dispatcher; each subcommand lives in `splash/commands/<name>.py`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from splash.core.model_config import ConfigError

# Each module exposes `register(subparsers)`, adding parsers whose `func(args) -> int` runs them.
COMMAND_MODULES = ("plan", "simulate", "model", "generate", "serve", "bench", "calibrate", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splash",
        description="Serve MLA models and switch the attention layout (TP, DP, CP, DOP) live.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"splash.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"splash.commands.{name}":
                continue  # subcommand not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"splash: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into e.g. `head` that closed early: not an error of ours.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the interpreter's final flush
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
