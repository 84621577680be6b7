"""RankTables: the page tables one rank keeps for the live requests, so step messages carry only deltas.

Rank 0 owns the allocators and the full tables (`Sequence.pages[r][j]`); every rank (rank 0 included,
it runs the same code) keeps its *own* row of each live request's table here and updates it from the
step messages (splash/step/wire.py): pages appended as requests grow, whole tables replaced after a
layout switch, requests dropped when they finish, are aborted or preempted.

The rows live side by side in one -1 padded int64 array [slots, width] (a request holds one slot), so
a step's [B, W] page table is one fancy index, whatever the context lengths; nothing here loops over
pages in Python.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class RankTables:
    """Local page ids of every live request on one rank (-1 where this rank does not hold the page)."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.slot: dict[int, int] = {}  # req_id -> row of `table`
        self.table = np.full((max(1, rows), max(1, width)), -1, dtype=np.int64)
        self.length = np.zeros(max(1, rows), dtype=np.int64)  # pages of each slot's table
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slot)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self.slot

    def ids(self) -> list[int]:
        return list(self.slot)

    def row(self, req_id: int) -> list[int]:
        """This rank's table of `req_id` (a copy; tests and debugging)."""
        s = self.slot[req_id]
        return self.table[s, :self.length[s]].tolist()

    def snapshot(self) -> dict[int, list[int]]:
        return {rid: self.row(rid) for rid in self.slot}

    # ---- updates ------------------------------------------------------------------------------------
    def _slot(self, req_id: int) -> int:
        s = self.slot.get(req_id)
        if s is not None:
            return s
        if not self._free:
            n = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
            self.length = np.concatenate([self.length, np.zeros_like(self.length)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        s = self._free.pop()
        self.slot[req_id] = s
        return s

    def _fit(self, width: int) -> None:
        w = self.table.shape[1]
        if width > w:
            new = max(width, 2 * w)
            grown = np.full((self.table.shape[0], new), -1, dtype=np.int64)
            grown[:, :w] = self.table
            self.table = grown

    def drop(self, req_ids: Iterable[int]) -> None:
        """Forget requests (finished, aborted, preempted); unknown ids are ignored."""
        for rid in req_ids:
            s = self.slot.pop(int(rid), None)
            if s is not None:
                self.table[s, :self.length[s]] = -1
                self.length[s] = 0
                self._free.append(s)

    def append(self, req_id: int, pages: np.ndarray) -> None:
        """Extend a request's table by `pages` (its next global pages; a new request starts empty)."""
        s = self._slot(int(req_id))
        n = int(self.length[s])
        k = len(pages)
        self._fit(n + k)
        self.table[s, n:n + k] = pages
        self.length[s] = n + k

    def replace(self, req_id: int, pages: np.ndarray) -> None:
        """Set a request's whole table (after a layout switch)."""
        s = self._slot(int(req_id))
        self.table[s, :self.length[s]] = -1
        self.length[s] = 0
        self.append(req_id, pages)

    # ---- the step's view ----------------------------------------------------------------------------
    def gather(self, req_ids: Iterable[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        """([B, width] tables of `req_ids` in order, -1 padded; [B] their lengths in pages). KeyError
        names a request whose table never reached this rank."""
        try:
            slots = [self.slot[r] for r in req_ids]
        except KeyError as e:
            raise KeyError(f"request {e.args[0]} has no page table on this rank (a step message was "
                           "lost or applied out of order)") from None
        self._fit(width)
        idx = np.asarray(slots, dtype=np.int64)
        return self.table[idx, :width], self.length[idx]
