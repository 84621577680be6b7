"""Rank 0's free list of state slots (KDA hybrids): a request holds one slot, the same index in every
KDA layer and rank, from admission to finish / abort / preemption. Kept apart from the per-rank state
tensors (splash/kv/state.py): rank 0 hands slots out, every rank holds their bytes."""

from __future__ import annotations


class OutOfSlots(RuntimeError):
    """Raised when a slot is asked for with none free; callers check `num_free` first."""


class SlotAllocator:
    """Rank 0's free list of state slots (LIFO, like the page lists)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are taken")
        s = self._free.pop()
        self._used[s] = True
        return s

    def free(self, slot: int) -> None:
        if slot < 0:
            return
        if not self._used[slot]:
            raise RuntimeError(f"state slot {slot} freed twice (scheduler bookkeeping bug)")
        self._used[slot] = False
        self._free.append(slot)
