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
`commit(plan)` after the switching step frees the retired pages and makes `dst` the allocator's
layout; `abort(plan)` (a plan that was never sent) frees the pages it allocated. Either way the
allocators balance exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from splash.config import ModelConfig, dtype_bytes, normalize_dtype
from splash.engine.plan import LAYOUTS
from splash.kv.allocator import KVAllocator, page_ranks, pages_for
from splash.manifest import Manifest, switch_manifest
from splash.switch.plan import MODES, Headroom, LayerSwitch, LiveRequest, SwitchPlan, SwitchRefusal

SHARDED = ("tp", "dop")
OWNED = ("dp", "dop")
_ids = itertools.count(1)


def dtype_name(dtype: object) -> str:
    """'bf16', torch.bfloat16, 'float64' ... -> the analytical core's short dtype name."""
    return normalize_dtype(str(dtype).removeprefix("torch."))


def head_range(layout: str, rank: int, world: int, heads: int) -> tuple[int, int]:
    """Heads a rank holds in `layout` (the model's `held_heads`): its 1/T slice if sharded."""
    if layout in SHARDED and world > 1:
        per = heads // world
        return rank * per, (rank + 1) * per
    return 0, heads


class SwitchPlanner:
    """Plans switches over the real page allocators (one per rank) and keeps them balanced."""

    def __init__(self, cfg: ModelConfig, alloc: KVAllocator, dtype: object = "bf16",
                 kv_dtype: object | None = None, reserve_pages: int | Sequence[int] = 0,
                 weight_headroom_bytes: float | Sequence[float] | None = None) -> None:
        cfg.check_ranks(alloc.world)
        self.cfg, self.alloc = cfg, alloc
        self.dtype = dtype_name(dtype)
        self.kv_dtype = dtype_name(kv_dtype if kv_dtype is not None else dtype)
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
        c = self.cfg
        return c.num_hidden_layers * self.alloc.page_size * c.latent_dim * dtype_bytes(self.kv_dtype)

    # ---- the plan -------------------------------------------------------------------------------
    def plan(self, dst: str, live: Sequence[LiveRequest],
             mode: str = "overlapped") -> SwitchPlan | SwitchRefusal:
        """Plan switching every request in `live` from the allocator's layout to `dst`.

        `live` must list every request that holds pages. Returns a refusal (state untouched) when the
        switch does not fit; raises ValueError for inconsistent input.
        """
        src, T, P = self.alloc.layout, self.world, self.alloc.page_size
        dst = str(dst).lower()
        if dst not in LAYOUTS:
            raise ValueError(f"unknown destination layout {dst!r}; choose one of {', '.join(LAYOUTS)}")
        if dst == src:
            raise ValueError(f"already running {src}; a switch needs a different destination")
        if mode not in MODES:
            raise ValueError(f"unknown switch mode {mode!r}; choose one of {', '.join(MODES)}")
        self._check_live(live)
        free = self.alloc.num_free
        owners = self._choose_owners(src, dst, live, free)
        if isinstance(owners, SwitchRefusal):
            return owners

        # Destination tables: keep what a rank already holds, mark what it must newly hold (-2).
        # One [T, n] array per request (numpy: a switch covers thousands of pages, and planning sits
        # on the switching step's critical path).
        tables, olds, fresh, new = [], [], [], np.zeros(T, dtype=np.int64)
        frees: list[list[int]] = [[] for _ in range(T)]
        growth = np.zeros(T, dtype=np.int64)
        for req, own in zip(live, owners):
            n, m = pages_for(req.end, P), pages_for(req.final, P)
            held = _holders(dst, m, own, T)
            hold = held[:, :n]
            old = _padded(req.pages, T, n)
            mine = old >= 0
            table = np.where(hold, np.where(mine, old, -2), -1)
            want = hold & ~mine
            new += want.sum(axis=1)
            gone = mine & ~hold
            for r in np.flatnonzero(gone.any(axis=1)):
                frees[r].extend(old[r][gone[r]].tolist())
            growth += held[:, n:].sum(axis=1)
            tables.append(table)
            olds.append(old)
            fresh.append(want)
        new_l, growth_l = new.tolist(), growth.tolist()
        batch = [(req.context, req.owner if src in OWNED else 0, own) for req, own in zip(live, owners)]
        man = switch_manifest(self.cfg, src, dst, batch, T, P, self.dtype, self.kv_dtype)
        L = self.cfg.num_hidden_layers
        w_growth = [(a - b) * L for a, b in zip(man.weights.recv_bytes, man.weights.freed_bytes)]
        room = Headroom(total_pages=self.alloc.num_total, used_pages=self.alloc.num_used, new_pages=new_l,
                        freed_pages=[len(f) for f in frees], growth_pages=growth_l,
                        reserve_pages=list(self.reserve), page_bytes=self.page_bytes,
                        in_transit_bytes=[float(x) for x in man.in_transit_bytes()],
                        weight_growth_bytes=[float(x) for x in w_growth],
                        weight_headroom_bytes=self.weight_headroom, returned_pages=list(self.returned))
        refusal = _check_headroom(src, dst, room)
        if refusal is not None:
            return refusal

        allocated = [self.alloc.ranks[r].alloc(new_l[r]) for r in range(T)]
        taken = [0] * T
        for table, want in zip(tables, fresh):
            for r in range(T):
                k = int(want[r].sum())
                if k:
                    table[r][want[r]] = allocated[r][taken[r]:taken[r] + k]
                    taken[r] += k
        try:
            pairs = _kv_pairs(man, live, tables, olds, fresh, P)
            weight_op = _weight_op(man, src, dst, T)
        except Exception:
            for r in range(T):
                self.alloc.ranks[r].free(allocated[r])
            raise
        H = self.cfg.num_attention_heads
        w, kv = man.weights, man.kv
        layers = [LayerSwitch(lm.layer, w.primitive, kv.primitive, [float(x) for x in w.send_bytes],
                              [float(x) for x in kv.send_bytes], [float(x) for x in w.recv_bytes],
                              [float(x) for x in kv.recv_bytes]) for lm in man.layers]
        plan = SwitchPlan(
            plan_id=next(_ids), src=src, dst=dst, world=T, page_size=P, num_layers=L, num_heads=H, mode=mode,
            weight_op=weight_op, src_heads=[head_range(src, r, T, H) for r in range(T)],
            dst_heads=[head_range(dst, r, T, H) for r in range(T)], layers=layers, kv_pairs=pairs,
            tables={req.req_id: t.tolist() for req, t in zip(live, tables)},
            owners={req.req_id: o for req, o in zip(live, owners)}, frees=frees, allocated=allocated,
            batch=batch, headroom=room)
        self.pending[plan.plan_id] = plan
        return plan

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
    def _check_live(self, live: Sequence[LiveRequest]) -> None:
        T, P = self.world, self.alloc.page_size
        seen: set[int] = set()
        count = np.zeros(T, dtype=np.int64)
        for req in live:
            if req.req_id in seen:
                raise ValueError(f"request {req.req_id} listed twice")
            seen.add(req.req_id)
            if len(req.pages) != T or len({len(row) for row in req.pages}) != 1:
                raise ValueError(f"request {req.req_id}: page table must have {T} rows of equal length")
            if not 0 <= req.context <= req.end:
                raise ValueError(f"request {req.req_id}: context {req.context} must be in "
                                 f"[0, tokens={req.end}]")
            have = len(req.pages[0])
            if have < pages_for(req.context, P) or have > pages_for(req.end, P):
                raise ValueError(f"request {req.req_id}: its table has {have} pages; it must cover the "
                                 f"{req.context} cached tokens and not exceed {req.end} tokens")
            if not 0 <= req.owner < T:
                raise ValueError(f"request {req.req_id}: owner {req.owner} is not a rank in [0, {T})")
            mine = np.asarray(req.pages, dtype=np.int64).reshape(T, have) >= 0
            orphan = np.flatnonzero(~mine[:, :pages_for(req.context, P)].any(axis=0))
            if orphan.size:
                raise ValueError(f"request {req.req_id}: cached page {int(orphan[0])} is held by no rank")
            count += mine.sum(axis=1)
        held = count.tolist()
        if held != self.alloc.num_used:
            raise ValueError(f"the live requests hold {held} pages per rank, the allocators have "
                             f"{self.alloc.num_used} in use; pass every request that holds pages")

    def _choose_owners(self, src: str, dst: str, live: Sequence[LiveRequest],
                       free: list[int]) -> list[int] | SwitchRefusal:
        """DP/DOP owners: kept from DP/DOP, else balanced by projected pages (LPT) where they fit."""
        if dst not in OWNED or src in OWNED:
            return [req.owner if src in OWNED else 0 for req in live]
        T, P = self.world, self.alloc.page_size
        load = [0] * T
        avail = [f - r for f, r in zip(free, self.reserve)]
        owners = [0] * len(live)
        order = sorted(range(len(live)), key=lambda i: (-pages_for(live[i].final, P), live[i].req_id))
        for i in order:
            req = live[i]
            n = pages_for(req.end, P)
            # pages rank r lacks to own the request (everything beyond what it holds now)
            need = (n - (_padded(req.pages, T, n) >= 0).sum(axis=1)).tolist()
            fits = [r for r in range(T) if need[r] <= avail[r]]
            if not fits:
                return SwitchRefusal(src, dst, "owners", f"request {req.req_id} ({req.end} tokens) fits on "
                                     f"no rank as owner: free pages beyond the reserve {avail}")
            best = min(fits, key=lambda r: (load[r], -avail[r], r))
            owners[i] = best
            load[best] += pages_for(req.final, P)
            avail[best] -= need[best]
        return owners


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


def _holders(layout: str, n: int, owner: int, T: int) -> np.ndarray:
    """`page_ranks` of pages 0..n-1 as a [T, n] mask (every layout's rule depends on the page index
    only through j % T, so T columns are asked and tiled)."""
    base = np.zeros((T, T), dtype=bool)
    for j in range(T):
        base[list(page_ranks(layout, j, owner, T)), j] = True
    return np.tile(base, (1, -(-n // T)))[:, :n]


def _padded(pages: list[list[int]], T: int, n: int) -> np.ndarray:
    """A [T, n] page table (-1 beyond the pages the request has now)."""
    out = np.full((T, n), -1, dtype=np.int64)
    have = len(pages[0]) if pages else 0
    if have:
        out[:, :have] = np.asarray(pages, dtype=np.int64).reshape(T, have)[:, :n]
    return out


def _kv_pairs(man: Manifest, live: Sequence[LiveRequest], tables: list[np.ndarray], olds: list[np.ndarray],
              fresh: list[np.ndarray], P: int) -> dict[tuple[int, int], np.ndarray]:
    """The core's page moves in local page ids; checks them (and its frees) against the tables:
    every page a rank newly holds must arrive exactly once, from a rank that holds it, and the core's
    frees must be exactly the pages the tables drop."""
    parts: dict[tuple[int, int], list[np.ndarray]] = {}
    got = [np.zeros((t.shape[0], pages_for(req.context, P)), dtype=np.int64) for req, t in zip(live, tables)]
    for mv in man.kv_moves():
        req, table, old = live[mv.request], tables[mv.request], olds[mv.request]
        j = np.asarray(mv.pages, dtype=np.int64)
        width = min(old.shape[1], table.shape[1])
        if j.size and (j.min() < 0 or j.max() >= width):
            raise RuntimeError(f"manifest moves pages {mv.pages[:4]} of request {req.req_id}, outside its "
                               f"{width} pages (core and placement rule disagree)")
        sp, dp = old[mv.src, j], table[mv.dst, j]
        if (sp < 0).any() or (dp < 0).any() or (old[mv.dst, j] >= 0).any():
            raise RuntimeError(f"manifest moves pages {mv.pages[:4]} of request {req.req_id} "
                               f"{mv.src}->{mv.dst}, which the page tables do not allow (core and placement "
                               "rule disagree)")
        np.add.at(got[mv.request][mv.dst], j, 1)
        n = np.minimum(P, req.context - j * P)
        parts.setdefault((mv.src, mv.dst), []).append(np.stack([sp, dp, n], axis=1))
    for i, (req, want) in enumerate(zip(live, fresh)):
        bad = np.argwhere(got[i] != want[:, :got[i].shape[1]])
        if bad.size:
            raise RuntimeError(f"manifest moves (rank, page) {bad[:4].tolist()} of request {req.req_id} "
                               "differ from the pages the destination tables need (core and placement rule "
                               "disagree)")
    dropped = [np.zeros_like(g) for g in got]
    for f in man.kv_frees():
        j = np.asarray(f.pages, dtype=np.int64)
        width = dropped[f.request].shape[1]
        if j.size and (j.min() < 0 or j.max() >= width):
            raise RuntimeError(f"manifest frees pages {f.pages[:4]} of request {live[f.request].req_id}, "
                               f"outside its {width} pages (core and placement rule disagree)")
        np.add.at(dropped[f.request][f.rank], j, 1)
    for i, (req, old, table) in enumerate(zip(live, olds, tables)):
        nc = dropped[i].shape[1]
        mine = ((old[:, :nc] >= 0) & (table[:, :nc] < 0)).astype(np.int64)
        bad = np.argwhere(dropped[i] != mine)
        if bad.size:
            raise RuntimeError(f"manifest frees (rank, page) {bad[:4].tolist()} of request {req.req_id} "
                               "differ from the tables' (core and placement rule disagree)")
    return {k: np.concatenate(v) for k, v in parts.items()}


def _weight_op(man: Manifest, src: str, dst: str, T: int) -> str:
    """'gather' / 'slice' / 'keep', checked against the core's weight moves and frees."""
    moves, frees = man.weight_moves(), man.weight_frees()
    if not moves and not frees:
        return "keep"
    if moves and not frees and src in SHARDED and dst not in SHARDED:
        H = man.sizes.heads
        per = H // T
        got = {(m.proj, m.src, m.dst, h) for m in moves for h in range(m.start, m.stop)}
        want = {(p.name, h // per, r, h) for p in man.sizes.projections for r in range(T) for h in range(H)
                if h // per != r}
        if got == want:
            return "gather"
    if frees and not moves and src not in SHARDED and dst in SHARDED:
        return "slice"
    raise RuntimeError(f"switch {src}->{dst}: the manifest's weight moves are neither an all-gather of head "
                       "slices nor a discard; the executor cannot run them")
