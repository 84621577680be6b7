"""What rank 0 sends every rank to switch the attention layout within one step (pure data, picklable).

A `SwitchPlan` is produced by `SwitchPlanner.plan` from the analytical core's manifest and the real
page allocators: per layer the primitive and bytes of weights and KV, which KV pages move between
which ranks (local page ids on both sides, and how many valid tokens each carries), which heads each
rank holds afterwards, the new page tables and owners, and which pages each rank frees at the end.
A switch that does not fit is a `SwitchRefusal` instead, with the numbers that refused it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from splash.step.plan import StepPlan

MODES = ("overlapped", "blocking")
# How a rank gets its destination projection blocks. "gather": all-gather every rank's head slice
# (sharded -> replicated); "slice": keep its own slice, drop the rest (replicated -> sharded);
# "keep": the placement does not change.
WEIGHT_OPS = ("gather", "slice", "keep")


@dataclass
class LiveRequest:
    """One request holding KV at the switch, as the engine knows it before the switching step."""

    req_id: int
    context: int  # tokens whose latent is in the cache: the history the switch carries over
    owner: int  # owning rank in the source layout (any value for TP/CP sources; kept for DP<->DOP)
    pages: list[list[int]]  # source page table pages[r][j] (-1 = rank r does not hold page j)
    tokens: int | None = None  # positions the table must cover after this step (default: context)
    projected: int | None = None  # expected final length: balances owners, prices Eq 6 (default: tokens)
    slot: int = -1  # a KDA hybrid's state slot (its recurrent and conv states move with the switch)

    @property
    def end(self) -> int:
        return self.context if self.tokens is None else self.tokens

    @property
    def final(self) -> int:
        return self.end if self.projected is None else max(self.projected, self.end)


@dataclass
class Headroom:
    """Per-rank numbers of Eq 5 (during the switch) and Eq 6 (after it), in pages and bytes.

    The KV pool's pages span every layer, so a page can only be retired after the last layer has
    been switched: during the switch a rank holds its source pages *and* its new destination pages.
    Eq 5 for this pool is therefore used + new + reserve <= total (i.e. new + reserve <= free), not
    max(M_a, M_b) + Delta_layer; the paper's per-layer form is reported alongside (`paper_eq5_bytes`).
    """

    total_pages: list[int]
    used_pages: list[int]  # before the switch
    new_pages: list[int]  # destination pages to allocate (held during the switch with the old ones)
    freed_pages: list[int]  # source pages retired at the end
    growth_pages: list[int]  # destination pages the requests' projected growth will need (Eq 6)
    reserve_pages: list[int]  # R_r
    page_bytes: float
    in_transit_bytes: list[float]  # Delta_layer_r: one layer's incoming weights + KV (manifest)
    weight_growth_bytes: list[float]  # W_r(b) - W_r(a) over all layers
    weight_headroom_bytes: list[float] | None = None  # free device bytes outside the pool, if known
    # pages that come back to the pool when the switch commits (the replica pages a DP/CP source
    # withholds): the destination's steady state (Eq 6) has them, the switch itself (Eq 5) does not
    returned_pages: list[int] | None = None

    @property
    def peak_pages(self) -> list[int]:
        return [u + n for u, n in zip(self.used_pages, self.new_pages)]

    @property
    def after_pages(self) -> list[int]:
        return [u + n - f for u, n, f in zip(self.used_pages, self.new_pages, self.freed_pages)]

    def eq5_ok(self) -> list[bool]:
        return [p + r <= t for p, r, t in zip(self.peak_pages, self.reserve_pages, self.total_pages)]

    @property
    def after_total_pages(self) -> list[int]:
        """The pool each rank has once the switch commits (its total plus the pages returned then)."""
        back = self.returned_pages or [0] * len(self.total_pages)
        return [t + b for t, b in zip(self.total_pages, back)]

    def eq6_ok(self) -> list[bool]:
        return [a + g + r <= t for a, g, r, t in
                zip(self.after_pages, self.growth_pages, self.reserve_pages, self.after_total_pages)]

    def weights_ok(self) -> list[bool]:
        """Projection replicas fit beside the pool: growth + one layer in transit <= headroom."""
        if self.weight_headroom_bytes is None:
            return [True] * len(self.total_pages)
        return [max(0.0, g) + d <= h for g, d, h in
                zip(self.weight_growth_bytes, self.in_transit_bytes, self.weight_headroom_bytes)]

    def paper_eq5_bytes(self) -> list[float]:
        """max(M_r(a), M_r(b)) + Delta_layer_r of the paper (KV pages + weight growth), for logs."""
        b = self.page_bytes
        return [max(u * b, a * b + max(0.0, w)) + d for u, a, w, d in
                zip(self.used_pages, self.after_pages, self.weight_growth_bytes, self.in_transit_bytes)]


@dataclass
class SwitchRefusal:
    """A switch that was not attempted; nothing was allocated or changed."""

    src: str
    dst: str
    reason: str  # "eq5" | "eq6" | "weights" | "owners" | "request" (the engine: it would strand one) |
    #              "shared" (prefix pages shared out of order: planner.SharedOutOfOrder)
    message: str
    headroom: Headroom | None = None

    def __str__(self) -> str:
        return f"switch {self.src}->{self.dst} refused ({self.reason}): {self.message}"


@dataclass
class LayerSwitch:
    """One layer's part of the manifest: primitive and per-rank bytes sent, for weights and KV."""

    layer: int
    weight_primitive: str
    kv_primitive: str
    weight_send_bytes: list[float]
    kv_send_bytes: list[float]
    weight_recv_bytes: list[float]
    kv_recv_bytes: list[float]


@dataclass
class SwitchPlan:
    """Everything every rank needs to execute one switch src -> dst during one step."""

    plan_id: int
    src: str
    dst: str
    world: int
    num_layers: int
    num_heads: int
    mode: str  # "overlapped" | "blocking"
    weight_op: str  # see WEIGHT_OPS
    src_heads: list[tuple[int, int]]  # [start, stop) of the heads rank r holds before ...
    dst_heads: list[tuple[int, int]]  # ... and after the switch
    layers: list[LayerSwitch]
    # (sender, receiver) -> int64 array [k, 3] of (sender local page, receiver local page, valid tokens),
    # every layer alike (arrays, not tuples: thousands of pages pickle as one buffer, and no per-page
    # Python objects are made on the switching step's critical path)
    kv_pairs: dict[tuple[int, int], np.ndarray]
    tables: dict[int, list[list[int]]]  # req_id -> destination page table
    owners: dict[int, int]  # req_id -> destination owner (meaningful for DP/DOP)
    frees: list[list[int]]  # per rank: local pages retired when the switch finishes
    allocated: list[list[int]]  # per rank: local pages allocated for the destination (abort frees them)
    batch: list[tuple[int, int, int]]  # (context, owner_src, owner_dst) per request: the manifest's input
    headroom: Headroom = field(repr=False, default=None)  # type: ignore[assignment]
    # KDA hybrids (else empty): the KDA layers, the KDA heads each rank holds before / after, and the
    # per-request state blocks every KDA layer moves alike: int64 [k, 4] rows (slot, KDA head, sender,
    # receiver) sorted by (sender, receiver, slot, head), and per rank the [k, 2] (slot, head) blocks it
    # keeps; the core's set differences of `held_state` (splash/core/holdings.py).
    kda_layers: tuple[int, ...] = ()
    src_kda_heads: list[tuple[int, int]] = field(default_factory=list)
    dst_kda_heads: list[tuple[int, int]] = field(default_factory=list)
    state_moves: np.ndarray | None = None
    state_keep: list[np.ndarray] = field(default_factory=list)

    @property
    def moves_kv(self) -> bool:
        return any(len(v) for v in self.kv_pairs.values())

    def kv_send_tokens(self, rank: int) -> list[int]:
        """Tokens `rank` sends to each rank per layer (its all-to-all send counts)."""
        return [self._tokens(rank, j) for j in range(self.world)]

    def kv_recv_tokens(self, rank: int) -> list[int]:
        return [self._tokens(s, rank) for s in range(self.world)]

    def _tokens(self, src: int, dst: int) -> int:
        pairs = self.kv_pairs.get((src, dst))
        return int(pairs[:, 2].sum()) if pairs is not None else 0

    def for_ranks(self) -> SwitchPlan:
        """The plan as the switching step carries it to every rank: what `SwitchExecutor` needs, without
        rank 0's bookkeeping (tables and owners, already in the step's slices; allocations, the
        manifest's input, headroom). It is pickled onto the step's critical path, and the tables alone
        were two thirds of it."""
        return dataclasses.replace(self, tables={}, owners={}, allocated=[], batch=[], headroom=None)

    def restep(self, plan: StepPlan) -> StepPlan:
        """The switching step's plan in the destination layout: same rows, new tables and owners."""
        seqs = []
        for s in plan.seqs:
            if s.req_id not in self.tables:
                raise ValueError(f"request {s.req_id} is in the step but not in the switch plan; "
                                 "pass every request that holds pages to SwitchPlanner.plan")
            table = self.tables[s.req_id]
            need = len(s.pages[0]) if s.pages else 0  # the source table, grown for this step's rows
            if len(table[0]) != need:
                raise ValueError(f"request {s.req_id}: switch table covers {len(table[0])} pages, the step "
                                 f"needs {need}; give LiveRequest.tokens = start + num_new")
            seqs.append(dataclasses.replace(s, owner=self.owners[s.req_id], pages=[row[:] for row in table]))
        return dataclasses.replace(plan, layout=self.dst, seqs=seqs)

    def summary(self) -> str:
        lay = self.layers[0] if self.layers else None
        if lay is None:
            return f"switch {self.src}->{self.dst}: no layers"
        w, kv = sum(lay.weight_send_bytes), sum(lay.kv_send_bytes)
        return (f"switch {self.src}->{self.dst} ({self.mode}): weights {lay.weight_primitive} "
                f"{w:.0f} B/layer, KV {lay.kv_primitive} {kv:.0f} B/layer over {self.num_layers} layers; "
                f"new pages {self.headroom.new_pages if self.headroom else '?'}, "
                f"freed {[len(f) for f in self.frees]}")
