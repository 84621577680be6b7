"""Bytes sent by each collective, per step and per layer, so measured traffic can be compared with
the analytical model (e.g. SPEC Eq 4 for the DOP exchange).

Counting convention (per rank, bytes this rank puts on the wire towards *other* ranks; self-copies
are free):
- all_to_all_var: the rows this rank sends to every other rank (exact, whatever the transport).
- all_gather_var: this rank's rows times (T - 1): every other rank must receive them.
- all_reduce: 2 * (T - 1) / T * payload, the ring algorithm's per-rank send volume.
- broadcast_object: the pickled payload times (T - 1) on the source, 0 elsewhere.
Summing one key over all ranks gives the group's total for that collective.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

Tag = int | str | None
Key = tuple[str, Tag]


@dataclass
class CommStats:
    """Byte counters keyed by (op, layer tag), for the current step and cumulatively."""

    enabled: bool = True
    step: int = -1
    current: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    total: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    history: dict[int, dict[Key, int]] = field(default_factory=dict)
    keep_history: int = 64  # steps kept in `history` (oldest dropped) so long runs stay bounded

    def begin_step(self, step: int) -> None:
        """Start counting a new step; the previous step's counters move into `history`."""
        if self.step >= 0 and self.current:
            self.history[self.step] = dict(self.current)
            while len(self.history) > self.keep_history:
                del self.history[min(self.history)]
        self.step = step
        self.current = defaultdict(int)

    def record(self, op: str, tag: Tag, nbytes: int) -> None:
        if not self.enabled:
            return
        key = (op, tag)
        self.current[key] += int(nbytes)
        self.total[key] += int(nbytes)
        self.calls[key] += 1

    def step_bytes(self, op: str | None = None, tag: Tag = ...) -> int:  # type: ignore[assignment]
        """Bytes this step, filtered by op and/or tag (`...` = any tag)."""
        return _sum(self.current, op, tag)

    def total_bytes(self, op: str | None = None, tag: Tag = ...) -> int:  # type: ignore[assignment]
        return _sum(self.total, op, tag)

    def per_layer(self, op: str | None = None) -> dict[Tag, int]:
        """This step's bytes per layer tag (optionally one op only)."""
        out: dict[Tag, int] = defaultdict(int)
        for (o, t), b in self.current.items():
            if op is None or o == op:
                out[t] += b
        return dict(out)

    def reset(self) -> None:
        self.step = -1
        self.current = defaultdict(int)
        self.total = defaultdict(int)
        self.calls = defaultdict(int)
        self.history = {}

    def reply(self, rank: int) -> dict[str, Any]:
        """What a rank sends rank 0 when asked for its counters: per step (kept history + current) and
        in total."""
        steps = {k: dict(v) for k, v in self.history.items()}
        if self.step >= 0:
            steps[self.step] = dict(self.current)
        return {"rank": rank, "steps": steps, "total": dict(self.total)}

    def snapshot(self) -> dict:
        """A JSON-friendly view: {"step", "current": {"op/tag": bytes}, "total": {...}}."""
        return {
            "step": self.step,
            "current": {f"{o}/{t}": b for (o, t), b in sorted(self.current.items(), key=str)},
            "total": {f"{o}/{t}": b for (o, t), b in sorted(self.total.items(), key=str)},
        }


def _sum(d: dict[Key, int], op: str | None, tag: Tag) -> int:
    return sum(b for (o, t), b in d.items() if (op is None or o == op) and (tag is ... or t == tag))
