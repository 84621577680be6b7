"""The prefix cache of KDA hybrids, as a stage: the snapshot row copies rank 0 decided (saves of a
request's state at its prompt's cacheable end, loads into the slots of requests that hit one) reach
every rank before the step they precede, in one "state" control message (splash/kv/snapshots.py)."""

from __future__ import annotations

from typing import Any

from splash.engine.stages.base import Stage


class Snapshots(Stage):
    """Sends the pending snapshot copies before each step (inert without a hybrid's prefix cache)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def before_execute(self, st: Any) -> None:
        cache = self.engine.allocator.cache
        snaps = cache.snaps if cache is not None else None
        if snaps is not None and snaps.pending:
            self.engine.runner.copy_state(snaps.take_pending())
