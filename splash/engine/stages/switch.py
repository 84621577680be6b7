"""Live layout switching's part in a step (T > 1 ranks; splash/switch/controller.py): the engine's
switcher decides and plans a switch into the scheduled step before the ranks run it, and commits it
after they did; its counters go into the engine's stats. Read from `engine.switcher` at each call (it is
attached once the rank group is up; None on one rank)."""

from __future__ import annotations

from typing import Any

from splash.engine.stages.base import Stage


class Switching(Stage):
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def before_execute(self, st: Any) -> None:
        if self.engine.switcher is not None:
            self.engine.switcher.before_execute(st)

    def after_execute(self, st: Any, logits: Any) -> None:
        if self.engine.switcher is not None:
            self.engine.switcher.after_execute(st)

    def stats(self) -> dict[str, Any]:
        sw = self.engine.switcher
        return sw.stats() if sw is not None else {}
