"""argparse types shared by the subcommands: checked values with one clear line instead of a traceback."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def output_file(text: str) -> str:
    """argparse type for --plot/--out: a file path whose folder exists and is writable, checked before a
    long measurement rather than when its result is written (and lost)."""
    import os

    folder = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder of {text!r} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (permission denied)")
    return text


def ranged(parse: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: `parse` the text and keep it only if `ok`; otherwise one clear line naming
    `what` was expected, instead of a traceback."""
    def convert(text: str) -> Any:
        try:
            v = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return convert


positive_float = ranged(float, lambda v: 0 < v < float("inf"), "a positive number of seconds")  # durations
positive_int = ranged(int, lambda v: v >= 1, "a positive integer")  # counts and sizes
