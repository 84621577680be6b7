"""One progress-bar factory, so every long command draws its bar the same way on stderr.

On a terminal the bar redraws in place (tqdm's default 0.1 s interval); when stderr is a file or a
pipe (CI logs, `make demo > log`) each redraw is a new line, so there it redraws at most every
`LOG_INTERVAL_S` seconds instead of flooding the log with one line per engine step.
"""

from __future__ import annotations

import sys
from typing import Any

LOG_INTERVAL_S = 10.0


def progress_bar(total: int, desc: str, unit: str, *, disable: bool = False) -> Any:
    """A tqdm bar on stderr (`disable=True` gives a silent one that accepts the same calls)."""
    from tqdm.auto import tqdm

    tty = getattr(sys.stderr, "isatty", lambda: False)()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable,
                mininterval=0.1 if tty else LOG_INTERVAL_S)
