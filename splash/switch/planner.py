"""Rank 0's side of a live layout switch: owners, destination pages, the manifest, the headroom check.

`SwitchPlanner(cfg, alloc, dtype)` wraps the per-rank page allocators (`KVAllocator`, whose `layout`
is the running layout). `plan(dst, live)`:
1. chooses destination owners for DP/DOP (kept from a DP/DOP source, where keeping them makes the
   switch a pure discard; otherwise longest-projected-first onto the least-loaded rank that has room,
   so ranks stay balanced by the KV they will end up holding);
2. lays out every request's destination table with the allocator's placement rule (`page_ranks`),
   keeping every page a rank already holds and counting the pages it must newly hold;
3. checks Eq 5 and Eq 6 with the real free pages (see `Headroom`) and refuses before touching
   anything if either fails;
4. allocates the new pages and asks the analytical core for the manifest (`switch_manifest`): the
   primitive and bytes of each layer and the concrete page moves come from there, never from a
   hand-written direction table; the planner only translates global pages into local page ids and
   checks that the core's moves and frees are exactly what the placement rule implies.
`check(dst, live)` is the same plan run dry (steps 1-3, nothing allocated): the one memory-feasibility
check, where only a yes/no is needed. `commit(plan)` after the switching step frees the retired pages
and makes `dst` the allocator's layout; `abort(plan)` (a plan that was never sent) frees the pages it
allocated. Either way the allocators balance exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import numpy.ma  # noqa: F401  (np.unique's first call imports it: 10-40 ms, on a switching step's plan)

from splash.core.layouts import Layout
from splash.core.manifest import Manifest, held_state, state_block_arrays, switch_manifest
from splash.core.model_config import ModelConfig, dtype_name
from splash.core.sizes import AttentionSizes
from splash.kv.allocator import KVAllocator, balanced_owners, page_ranks
from splash.kv.prefix import moved_columns
from splash.kv.snapshots import holder
from splash.step.plan import LAYOUTS
from splash.switch.columns import Columns, first_bad, request_error, request_scalars
from splash.switch.manifest_check import kv_pairs, weight_op
from splash.switch.plan import MODES, Headroom, LayerSwitch, LiveRequest, SwitchPlan, SwitchRefusal

_ids = itertools.count(1)


def head_range(layout: str, rank: int, world: int, heads: int) -> tuple[int, int]:
    """Heads a rank holds in `layout` (the layout table's rule), as the plan's picklable (start, stop)."""
    held = Layout.named(layout).heads(rank, world, heads)
    return held.start, held.stop


class SharedOutOfOrder(ValueError):
    """Live tables share prefix pages in an order a switch cannot lay out (an aliased page after a
    request's own pages: two requests registered parts of one prefix chain, e.g. a KDA hybrid's match
    cut back to its snapshot while another request registered the blocks past it). Not a bookkeeping
    bug: the switch is refused until those requests finish (`SwitchController`)."""


class SwitchPlanner:
    """Plans switches over the real page allocators (one per rank) and keeps them balanced."""

    def __init__(self, cfg: ModelConfig, alloc: KVAllocator, dtype: object = "bf16",
                 kv_dtype: object | None = None, reserve_pages: int | Sequence[int] = 0,
                 weight_headroom_bytes: float | Sequence[float] | None = None) -> None:
        cfg.check_ranks(alloc.world)
        self.cfg, self.alloc = cfg, alloc
        self.dtype = dtype_name(dtype)
        # the pool's element format (resolved once: RuntimeSpec.kv_format; None: the plain dtype's)
        self.sizes = AttentionSizes(cfg, self.dtype, self.dtype if kv_dtype is None else str(kv_dtype))
        self.kv_dtype = self.sizes.kv_dtype  # (one per planner: it memoises weights)
        self._weight_ops: dict[tuple[object, ...], str] = {}
        T = alloc.world
        self.reserve = [int(reserve_pages)] * T if isinstance(reserve_pages, int) else list(reserve_pages)
        if weight_headroom_bytes is None or isinstance(weight_headroom_bytes, (list, tuple)):
            self.weight_headroom = None if weight_headroom_bytes is None else list(weight_headroom_bytes)
        else:
            self.weight_headroom = [float(weight_headroom_bytes)] * T  # type: ignore[arg-type]
        self.returned = [0] * T  # pages the next switch returns at commit (a DP/CP source's replicas)
        self.pending: dict[int, SwitchPlan] = {}

    @property
    def world(self) -> int:
        return self.alloc.world

    @property
    def page_bytes(self) -> float:
        return self.alloc.page_size * self.sizes.k  # every layer and per-token store (splash.core.sizes)

    # ---- the plan -------------------------------------------------------------------------------
    def plan(self, dst: str, live: Sequence[LiveRequest],
             mode: str = "overlapped") -> SwitchPlan | SwitchRefusal:
        """Plan switching every request in `live` from the allocator's layout to `dst`.

        `live` must list every request that holds pages. Returns a refusal (state untouched) when the
        switch does not fit; raises ValueError for inconsistent input.
        """
        return self._plan(dst, live, mode, dry_run=False)  # type: ignore[return-value]

    def check(self, dst: str, live: Sequence[LiveRequest], mode: str = "overlapped",
              cols: Columns | None = None) -> SwitchRefusal | None:
        """`plan` as a dry run: the same owners, destination tables and Eq 5/6 checks, nothing allocated;
        the refusal `plan` would return, or None where it would plan the switch. The engine's one
        memory-feasibility check (`SwitchController.fitting` asks it before the Policy weighs a layout).
        Without `weight_headroom` the manifest is not built: only the weights check reads its bytes.
        `cols`: `columns(live)` when several destinations are checked for the same batch."""
        out = self._plan(dst, live, mode, dry_run=True, cols=cols)
        return out if isinstance(out, SwitchRefusal) else None

    def _plan(self, dst: str, live: Sequence[LiveRequest], mode: str,
              dry_run: bool, cols: Columns | None = None) -> SwitchPlan | SwitchRefusal | None:
        src, T, P = self.alloc.layout, self.world, self.alloc.page_size
        dst = str(dst).lower()
        if dst not in LAYOUTS:
            raise ValueError(f"unknown destination layout {dst!r}; choose one of {', '.join(LAYOUTS)}")
        if dst == src:
            raise ValueError(f"already running {src}; a switch needs a different destination")
        if mode not in MODES:
            raise ValueError(f"unknown switch mode {mode!r}; choose one of {', '.join(MODES)}")
        if self.cfg.is_hybrid and any(req.slot < 0 for req in live):
            bad = [req.req_id for req in live if req.slot < 0]
            raise ValueError(f"requests {bad[:5]} hold pages but no state slot; a KDA model's live "
                             "requests each need one")
        cols = self.columns(live) if cols is None else cols
        free = self.alloc.num_free
        src_l, dst_l = self.alloc.core_layout, Layout.named(dst)  # (the core's layouts, once per plan)
        owners = self._choose_owners(src_l, dst_l, live, cols, free)
        if isinstance(owners, SwitchRefusal):
            return owners

        # Destination tables: keep what a rank already holds, mark what it must newly hold (-2).
        # Every request's table side by side in one [T, pages] array (see `Columns`): a switch
        # covers thousands of pages of up to hundreds of requests, on the switching step's critical path.
        # A prefix-cache page several tables share is one page: its first column stands for it
        # (allocated, moved and freed there) and the others take that column's destination pages.
        own = np.asarray(owners, dtype=np.int64)
        old = cols.old
        hold = _holders(dst, own[cols.req], cols.page, T)
        mine = cols.mine
        table = np.where(hold, np.where(mine, old, -2), -1)
        fresh = hold & ~mine & ~cols.alias
        gone = mine & ~hold & ~cols.alias
        frees = [old[r, gone[r]].tolist() for r in range(T)]
        new_l = fresh.sum(axis=1).tolist()
        growth_l = _growth(dst, own, cols.n, cols.final, T).tolist()
        kept = src_l.owned  # source owners mean something (DP/DOP)
        first = cols.first_own.tolist()
        batch = [(req.context, req.owner if kept else 0, o, k) for req, o, k in zip(live, owners, first)]
        L = self.cfg.num_attn_layers  # (served MTP layers included: their weights and KV switch too)
        man, in_transit, w_growth = None, [0.0] * T, [0.0] * T
        if not dry_run or self.weight_headroom is not None:  # (only the weights check reads its bytes)
            man = switch_manifest(self.sizes, src_l, dst_l, batch, T, P)
            in_transit = [float(x) for x in man.in_transit_bytes()]
            w_growth = [float((a - b) * L) for a, b in zip(man.weights.recv_bytes, man.weights.freed_bytes)]
        room = Headroom(total_pages=self.alloc.num_total, used_pages=self.alloc.num_used, new_pages=new_l,
                        freed_pages=[len(f) for f in frees], growth_pages=growth_l,
                        reserve_pages=list(self.reserve), page_bytes=self.page_bytes,
                        in_transit_bytes=in_transit, weight_growth_bytes=w_growth,
                        weight_headroom_bytes=self.weight_headroom, returned_pages=list(self.returned))
        refusal = _check_headroom(src, dst, room)
        if refusal is not None or dry_run:
            return refusal
        assert man is not None

        allocated = [self.alloc.ranks[r].alloc(new_l[r]) for r in range(T)]
        for r in range(T):
            if new_l[r]:
                table[r, fresh[r]] = allocated[r]  # column order = request order, then page order
        if cols.alias.any():
            table[:, cols.alias] = table[:, cols.rep[cols.alias]]
        try:
            pairs = kv_pairs(man.kv_pages(), live, cols, table, fresh, P)
            weight_op = self._weight_op(man, src, dst)
        except Exception:
            for r in range(T):
                self.alloc.ranks[r].free(allocated[r])
            raise
        H = self.cfg.num_attention_heads

        def floats(v: Sequence[float]) -> list[float]:
            return [float(x) for x in v]

        # each layer's own KV bytes: a GLM-5 "shared" layer carries no indexer keys
        # (a hybrid's KDA layer: its KDA weights, and its request states in the KV columns)
        layers = []
        for lm in man.layers:
            lw, kv = lm.weights, (lm.state if lm.state is not None else lm.kv)
            layers.append(LayerSwitch(lm.layer, lw.primitive, kv.primitive, floats(lw.send_bytes),
                                      floats(kv.send_bytes), floats(lw.recv_bytes), floats(kv.recv_bytes)))
        plan = SwitchPlan(
            plan_id=next(_ids), src=src, dst=dst, world=T, num_layers=L, num_heads=H, mode=mode,
            weight_op=weight_op, src_heads=[head_range(src, r, T, H) for r in range(T)],
            dst_heads=[head_range(dst, r, T, H) for r in range(T)], layers=layers, kv_pairs=pairs,
            tables=_split(table, live, cols.off),
            owners={req.req_id: o for req, o in zip(live, owners)}, frees=frees, allocated=allocated,
            batch=batch, headroom=room)
        if self.cfg.is_hybrid:
            self._add_state(plan, man, live)
        self.pending[plan.plan_id] = plan
        return plan

    def _add_state(self, plan: SwitchPlan, man: Manifest, live: Sequence[LiveRequest]) -> None:
        """A hybrid's KDA part of the plan: KDA head ranges and the state blocks of the manifest
        (request index -> the request's slot), sorted for the executor's all-to-all."""
        T, src, dst = self.world, plan.src, plan.dst
        Hk = self.cfg.linear_num_heads
        slots = np.array([req.slot for req in live], dtype=np.int64)
        mv = man.state_blocks().moves
        oa = np.array([r.owner_src for r in man.requests], dtype=np.int64)
        ob = np.array([r.dst_owner for r in man.requests], dtype=np.int64)
        rows, sa, sb = self._snapshots(plan, live)
        if len(rows):  # the prefix cache's state snapshots move as live state does, after the live slots
            smv = state_block_arrays(Layout(src), Layout(dst), sa, sb, T, Hk)[0].moves
            mv = np.concatenate([mv, smv + np.array([len(live), 0, 0, 0], dtype=np.int64)])
            slots, oa, ob = np.concatenate([slots, rows]), np.concatenate([oa, sa]), np.concatenate([ob, sb])
        if len(mv):
            mv = np.stack([slots[mv[:, 0]], mv[:, 1], mv[:, 2], mv[:, 3]], axis=1)
            mv = mv[np.lexsort((mv[:, 1], mv[:, 0], mv[:, 3], mv[:, 2]))]
        kept = held_state(Layout(src), oa, T, Hk) & held_state(Layout(dst), ob, T, Hk)
        keep = []
        for r in range(T):
            i, h = np.nonzero(kept[r])
            keep.append(np.stack([slots[i], h], axis=1).astype(np.int64))
        plan.kda_layers = tuple(self.cfg.kda_layers or ())
        plan.src_kda_heads = [head_range(src, r, T, Hk) for r in range(T)]
        plan.dst_kda_heads = [head_range(dst, r, T, Hk) for r in range(T)]
        plan.state_moves = mv.astype(np.int64)
        plan.state_keep = keep

    def _snapshots(self, plan: SwitchPlan, live: Sequence[LiveRequest]) -> tuple[np.ndarray, ...]:
        """A hybrid's prefix-cache snapshots that survive the switch (their blocks are held by live
        tables; the others were flushed before it): (state rows, holder before, holder after). A
        block's pages go where its holders' do (`prefix.moved_columns`, the map the cache's blocks
        follow at the commit), and in DP-attention its snapshot sits with them (`snapshots.holder`);
        elsewhere the holder is unused."""
        cache = self.alloc.cache
        snaps = None if cache is None else cache.snaps
        empty = np.zeros(0, dtype=np.int64)
        if snaps is None or not snaps.num_used:
            return empty, empty, empty
        moved = moved_columns((req.pages, plan.tables.get(req.req_id)) for req in live)
        rows, sa, sb = [], [], []
        for b in cache.live_blocks():
            new = moved.get(tuple(b.column)) if b.snap >= 0 else None
            if new is not None:  # (a held block the tables do not carry: cache.moved raises for it)
                rows.append(b.snap)
                sa.append(holder(b.column))
                sb.append(holder(new))
        return (np.array(rows, dtype=np.int64), np.array(sa, dtype=np.int64), np.array(sb, dtype=np.int64))

    def commit(self, plan: SwitchPlan, freed: Sequence[int] | None = None) -> None:
        """After the switching step: retire the source pages; `dst` becomes the running layout.
        `freed` (optional) is rank 0's `SwitchExecutor.finish().freed`, checked against the plan."""
        self._take(plan)
        if freed is not None and sorted(freed) != sorted(plan.frees[0]):
            raise RuntimeError(f"rank 0 freed {sorted(freed)}, the plan retires {sorted(plan.frees[0])}")
        for r in range(self.world):
            self.alloc.ranks[r].free(plan.frees[r])
        self.alloc.layout = plan.dst

    def abort(self, plan: SwitchPlan) -> None:
        """A plan that no rank executed: give its destination pages back; nothing else changed."""
        self._take(plan)
        for r in range(self.world):
            self.alloc.ranks[r].free(plan.allocated[r])

    def _take(self, plan: SwitchPlan) -> None:
        if self.pending.pop(plan.plan_id, None) is None:
            raise RuntimeError(f"switch plan {plan.plan_id} is not pending (committed or aborted already?)")
        if plan.src != self.alloc.layout:
            raise RuntimeError(f"switch plan {plan.src}->{plan.dst}, but the allocator runs "
                               f"{self.alloc.layout}")

    # ---- helpers --------------------------------------------------------------------------------
    def columns(self, live: Sequence[LiveRequest]) -> Columns:
        """Raise ValueError for inconsistent requests (the first bad request, in order); return their
        source tables side by side: what every destination's plan starts from (made once when several
        destinations are checked for the same batch)."""
        T, P = self.world, self.alloc.page_size
        scalars = request_scalars(live, P, T)
        ok = first_bad(live, scalars, T)
        cols = Columns.of(live[:ok], T, P, scalars[:ok])
        orphan = cols.first_orphan()
        if orphan is not None:  # an earlier request than the first bad one (only valid ones were laid out)
            i, j = orphan
            raise ValueError(f"request {live[i].req_id}: cached page {j} is held by no rank")
        if ok < len(live):
            raise ValueError(request_error(live[ok], {req.req_id for req in live[:ok]}, T, P))
        why = cols.shared_error()
        if why is not None:
            raise SharedOutOfOrder(why)
        held = (cols.mine & ~cols.alias).sum(axis=1).tolist()
        if held != self.alloc.num_used:
            raise ValueError(f"the live requests hold {held} pages per rank, the allocators have "
                             f"{self.alloc.num_used} in use; pass every request that holds pages")
        return cols

    def _weight_op(self, man: Manifest, src: str, dst: str) -> str:
        """`_weight_op`, checked once per direction: the core's weight moves and frees depend on nothing
        but the layouts and T, and `self.sizes` memoises them, so every later manifest built on it
        carries the very moves already checked (checking DeepSeek-V3's 128 heads on 8 ranks takes
        1.5 ms, on the switching step's critical path)."""
        if man.sizes is not self.sizes:
            return weight_op(man, src, dst, self.world)
        key = (src, dst, man.src, man.dst, man.ranks)
        if key not in self._weight_ops:
            self._weight_ops[key] = weight_op(man, src, dst, self.world)
        return self._weight_ops[key]

    def _choose_owners(self, src: Layout, dst: Layout, live: Sequence[LiveRequest], cols: Columns,
                       free: list[int]) -> list[int] | SwitchRefusal:
        """DP/DOP owners: kept from DP/DOP, else balanced by projected pages (LPT) where they fit."""
        kept = src.owned
        if not dst.owned or kept:
            return [req.owner if kept else 0 for req in live]
        avail = [f - r for f, r in zip(free, self.reserve)]
        # Requests sharing prefix pages go to one owner together (the page lives once, on it): the
        # one owner rule places each group as a unit, by the pages its members do not share.
        group = _groups(cols)
        k = group.max(initial=-1) + 1
        own_pages = cols.n - cols.first_own
        final = np.bincount(group, cols.final - cols.first_own, k).astype(np.int64)
        # pages rank r lacks to own each group (everything beyond what it holds now)
        lacks = np.stack([np.bincount(group, own_pages - h, k) for h in cols.held_per_request()], axis=1)
        ids = [min(req.req_id for req, g in zip(live, group) if g == x) for x in range(k)]
        got, stuck, left = balanced_owners(final.tolist(), lacks.astype(np.int64).tolist(), avail, ids)
        if stuck is not None:
            req = next(req for req, g in zip(live, group) if g == stuck)
            return SwitchRefusal(src.value, dst.value, "owners", f"request {req.req_id} ({req.end} tokens, "
                                 "with the requests sharing its prefix) fits on no rank as owner: free pages "
                                 f"beyond the reserve {left}")
        return [got[g] for g in group.tolist()]


def _check_headroom(src: str, dst: str, room: Headroom) -> SwitchRefusal | None:
    pb = room.page_bytes
    for name, ok in (("eq5", room.eq5_ok()), ("eq6", room.eq6_ok()), ("weights", room.weights_ok())):
        bad = [r for r, good in enumerate(ok) if not good]
        if not bad:
            continue
        r = bad[0]
        if name == "eq5":
            msg = (f"rank {r} would hold {room.used_pages[r]} source + {room.new_pages[r]} new pages "
                   f"(+{room.reserve_pages[r]} reserve) of {room.total_pages[r]} during the switch "
                   f"({(room.peak_pages[r] + room.reserve_pages[r]) * pb:.0f} > "
                   f"{room.total_pages[r] * pb:.0f} B)")
        elif name == "eq6":
            msg = (f"rank {r} would hold {room.after_pages[r]} pages + {room.growth_pages[r]} for projected "
                   f"growth (+{room.reserve_pages[r]} reserve) of {room.after_total_pages[r]} in {dst}")
        else:
            want = max(0.0, room.weight_growth_bytes[r]) + room.in_transit_bytes[r]
            msg = (f"rank {r} needs {want:.0f} B for projection replicas, "
                   f"{room.weight_headroom_bytes[r]:.0f} B free")  # type: ignore[index]
        return SwitchRefusal(src, dst, name, msg + f" (ranks over: {bad})", room)
    return None


def _groups(cols: Columns) -> np.ndarray:
    """[B] group of each request: requests sharing a page (transitively) are one group, numbered in
    order of first appearance (no sharing: request i is group i)."""
    B = len(cols.n)
    parent = np.arange(B)
    if cols.alias.any():
        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x
        c = np.nonzero(cols.alias)[0]
        for a, b in set(zip(cols.req[c].tolist(), cols.req[cols.rep[c]].tolist())):
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        parent = np.array([find(i) for i in range(B)])
    _, group = np.unique(parent, return_inverse=True)
    return group.astype(np.int64)


@lru_cache(maxsize=64)
def _placement(layout: str, T: int) -> np.ndarray:
    """[rank, owner, j % T] bool: `page_ranks` of page j for each owner. Every layout's rule depends on
    the page index only through j % T, so T pages per owner are asked once and reused."""
    base = np.zeros((T, T, T), dtype=bool)
    for owner in range(T):
        for j in range(T):
            base[list(page_ranks(layout, j, owner, T)), owner, j] = True
    base.setflags(write=False)
    return base


def _holders(layout: str, owners: np.ndarray, pages: np.ndarray, T: int) -> np.ndarray:
    """`page_ranks` of (owner, page) columns as a [T, columns] mask."""
    return _placement(layout, T).reshape(T, T * T)[:, owners * T + pages % T]


def _growth(layout: str, owners: np.ndarray, n: np.ndarray, final: np.ndarray, T: int) -> np.ndarray:
    """[T] pages each rank will add for pages n .. final-1 of every request (Eq 6's projected growth),
    counted per residue j % T without listing the pages."""
    k = np.arange(T)
    per_residue = (final[:, None] - k + T - 1) // T - (n[:, None] - k + T - 1) // T  # [B, j % T]
    return (_placement(layout, T)[:, owners, :] * per_residue).sum(axis=(1, 2))


def _split(table: np.ndarray, live: Sequence[LiveRequest], off: np.ndarray) -> dict[int, list[list[int]]]:
    """req_id -> its [T][n] destination table, cut from the side-by-side array."""
    rows, at = table.tolist(), off.tolist()
    return {req.req_id: [row[a:b] for row in rows] for req, a, b in zip(live, at, at[1:])}
