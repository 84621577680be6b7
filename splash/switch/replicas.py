"""Replica memory of live switching: the KV pages that replicated attention projections take.

With a `--memory-per-rank` budget and switching enabled, every rank's KV pool is sized as if its
attention projections were head-sharded (the largest pool the budget allows, splash/worker/load.py),
and while the engine runs a replicated-projection layout (DP, CP) the pages those replicas occupy are
withheld from the allocators (`replica_pages` per rank, `ReplicaPages`). So each layout gets exactly
the KV capacity the budget gives it - DOP admits more than DP, TP holds 1/T of DOP's distinct tokens -
and a switch into DP/CP must find room for the replicas (the planner's Eq 5/6 check counts them as a
reserve).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splash.core.layouts import Layout
from splash.core.model_config import ConfigError
from splash.kv.allocator import KVAllocator


def replicas(layout: str) -> bool:
    """Whether `layout` holds every head's projections on every rank (DP, CP): the replicas beyond a
    rank's own head slice take pool pages."""
    return not Layout.named(layout).sharded


def replica_bytes(model: Any, world: int) -> int:
    """Bytes of attention projections a rank holds beyond its 1/T head slice when they are replicated
    (what a switch into DP/CP gathers, and a switch into TP/DOP drops)."""
    full = 0
    for layer in model.attn_layers():  # (a hybrid's KDA layers have their own head count)
        a = layer.self_attn
        held = sum(t.numel() * t.element_size() for t in a.head_tensors().values())
        full += held * a.total_heads // max(1, len(a.heads))  # every head's blocks, whatever is held now
    return int(full * (1 - 1 / world))


def replica_pages(model: Any, world: int, page_bytes: int) -> int:
    """Pages of one rank's KV pool that the replicated projections take (ceil)."""
    return -(-replica_bytes(model, world) // page_bytes) if world > 1 else 0


def withhold(alloc: KVAllocator, pages: Sequence[int]) -> list[list[int]]:
    """Take `pages[r]` pages out of rank r's pool (replica weights live there now); returns their ids.
    The allocators keep the books (`PageAllocator.withhold`)."""
    return [a.withhold(n) for a, n in zip(alloc.ranks, pages)]


def give_back(alloc: KVAllocator) -> None:
    """Undo `withhold`."""
    for a in alloc.ranks:
        a.give_back()


class ReplicaPages:
    """Rank 0's account of the pages replicas take: how many per rank (`weight_pages`, 0 without a
    budget), which are withheld now (`withheld`), and what each layout's pools hold net of them."""

    def __init__(self, alloc: KVAllocator, weight_pages: Sequence[int] | None, page_bytes: float) -> None:
        self.alloc = alloc
        self.weight_pages = list(weight_pages) if weight_pages is not None else [0] * alloc.world
        self.withheld: list[list[int]] = [[] for _ in range(alloc.world)]
        self._distinct: dict[str, int] = {}  # distinct_tokens per layout while the pools keep their size
        if replicas(alloc.layout) and any(self.weight_pages):
            short = [(r, a.num_pages, w) for r, (a, w) in enumerate(zip(alloc.ranks, self.weight_pages))
                     if w >= a.num_pages]
            if short:
                r, have, w = short[0]
                raise ConfigError(f"--memory-per-rank leaves rank {r} {have} KV pages in a sharded layout; "
                                  f"{alloc.layout}'s replicated attention projections take {w} of them, "
                                  f"which leaves no KV cache; raise --memory-per-rank by at least "
                                  f"{(w - have + 1) * page_bytes / 2**20:.2f} MiB, or start in tp or dop")
            self.withheld = withhold(alloc, self.weight_pages)

    def capacity(self, dst: str) -> list[int]:
        """KV pages each rank can give requests in `dst` (the replicas' pages withheld in DP/CP)."""
        return [a.num_pages + len(w) - (wp if replicas(dst) else 0)
                for a, w, wp in zip(self.alloc.ranks, self.withheld, self.weight_pages)]

    def distinct_tokens(self, dst: str) -> int:
        """Distinct KV tokens the group holds in `dst` (the layout table's count: TP one rank's share).
        Asked for every layout at every step that requests wait; the pools only change size here, when
        replicas' pages are withheld or given back (`switched`)."""
        n = self._distinct.get(dst)
        if n is None:
            n = self._distinct[dst] = Layout.named(dst).distinct(self.capacity(dst)) * self.alloc.page_size
        return n

    def reserve(self, dst: str) -> list[int]:
        """Pages per rank a switch into `dst` must find for projection replicas (entering DP/CP)."""
        src = self.alloc.layout
        return [w if replicas(dst) and not replicas(src) else 0 for w in self.weight_pages]

    def returned(self, dst: str) -> list[int]:
        """Pages per rank a switch into `dst` gives back at commit (leaving DP/CP: dst's Eq 6 has them)."""
        return [len(w) if not replicas(dst) else 0 for w in self.withheld]

    def switched(self, src: str, dst: str) -> None:
        """A switch `src` -> `dst` committed: withhold the replicas' pages entering DP/CP, give them back
        leaving."""
        self._distinct.clear()
        if replicas(dst) and not replicas(src) and any(self.weight_pages):
            self.withheld = withhold(self.alloc, self.weight_pages)
        elif not replicas(dst) and replicas(src) and any(len(w) for w in self.withheld):
            give_back(self.alloc)
            self.withheld = [[] for _ in range(self.alloc.world)]
