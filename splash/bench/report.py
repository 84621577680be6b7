"""What every multi-rank benchmark does once its measurement returns: errors, plot, JSON or table."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def report(name: str, args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict[str, Any]],
           table: Callable[[dict[str, Any]], str],
           plot: Callable[[dict[str, Any], str], None]) -> int:
    """Run `measure(args)` and print its result; bad input exits 2, a failed rank exits 1, one line each."""
    try:
        doc = measure(args)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"splash bench {name}: error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as e:  # WorkerError and GroupFailed are RuntimeErrors
        print(f"splash bench {name}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    path = getattr(args, "plot", None)
    if path:
        plot(doc, path)
    if args.json:
        print(json.dumps(doc))
    else:
        print(table(doc))
        if path:
            print(f"plot: {path}")
    return 0


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """Lay out, write and close a benchmark's matplotlib figure (every `--plot`)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
