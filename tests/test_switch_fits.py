"""The engine's memory pre-check of a switch (`SwitchController.fits`, what `auto` asks before it
proposes a layout) against the planner's own verdict (`SwitchPlanner.plan`: Eq 5, Eq 6, owners).

Random live batches on real page allocators (T = 2 and 4, tight pools, DP/CP replica pages withheld
under a budget): for every direction, `fits` says yes exactly when the planner plans the switch. A
disagreement either wastes a plan on the switching step's critical path (the planner refuses what
`fits` let through: leaving DP/CP without counting the replica pages that come back did this) or
keeps `auto` out of a layout it could run.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from splash.core.presets import PRESETS
from splash.kv.allocator import KVAllocator, OutOfPages
from splash.runtime_spec import RuntimeSpec
from splash.switch.controller import SwitchController
from splash.switch.plan import SwitchRefusal

LAYOUTS = ("tp", "dp", "cp", "dop")


def spec_for(world: int, layout: str) -> RuntimeSpec:
    """The `tiny` shape in float32 on `world` ranks starting in `layout` (a fixed layout: no policy)."""
    return RuntimeSpec.for_tests(PRESETS["tiny"], dtype=torch.float32, world=world, layout=layout)


def live_batch(rng: random.Random, alloc: KVAllocator, src: str) -> tuple[list[SimpleNamespace], dict]:
    """Requests grown on `alloc` in `src`, each with a prompt and a max_tokens limit (its projection),
    and this step's rows per request: some tables already cover them (as the scheduler grows them),
    some do not (the planner then counts those pages as new)."""
    live, rows = [], {}
    for i in range(rng.randint(1, 10)):
        prompt = rng.randint(1, 40)
        ctx = rng.randint(1, prompt + 20)
        new = rng.choice([0, 0, rng.randint(1, 6)])
        owner = rng.randrange(alloc.world) if src in ("dp", "dop") else 0
        table = alloc.empty_table()
        try:
            alloc.grow(table, ctx + rng.choice([0, new]), owner)
        except OutOfPages:
            break
        live.append(SimpleNamespace(seq_id=i, num_computed=ctx, num_tokens=ctx + new, owner=owner, slot=-1,
                                    pages=table, params=SimpleNamespace(max_tokens=rng.randint(1, 60)),
                                    prompt_token_ids=[0] * prompt))
        rows[i] = new
    return live, rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fits_agrees_with_the_planner(seed):
    rng = random.Random(seed)
    verdicts: set[tuple[bool, str | None]] = set()
    dropped = 0
    for _ in range(300):
        T, src = rng.choice([2, 4]), rng.choice(LAYOUTS)
        alloc = KVAllocator(rng.randint(8, 60), rng.choice([4, 16]), world=T, layout=src)
        engine = SimpleNamespace(allocator=alloc, scheduler=SimpleNamespace(
            running=[], waiting=[], cfg=SimpleNamespace(max_model_len=4096)))
        withheld = rng.choice([0, 0, rng.randint(1, 6)])  # replica pages per rank under a budget
        ctl = SwitchController(engine, spec_for(T, src), weight_pages=[withheld] * T)
        live, rows = live_batch(rng, alloc, src)
        if not live:
            continue
        step = SimpleNamespace(seqs=[SimpleNamespace(req_id=i, num_new=n) for i, n in rows.items() if n])
        for dst in LAYOUTS:
            if dst == src:
                continue
            pre = ctl.fits(dst, live, rows)
            plan = ctl._plan(dst, step, live, "overlapped")
            planned = not isinstance(plan, SwitchRefusal)
            if planned:
                ctl.planner.abort(plan)
            assert pre == planned, (f"{src}->{dst} T={T}: fits says {pre}, the planner "
                                    f"{'planned it' if planned else plan}")
            verdicts.add((planned, None if planned else plan.reason))
            # The cheap pre-filter (distinct pages vs the batch at its limits) only drops what the
            # planner refuses; `fits` asks it first, so the agreement above covers it too.
            roomy = ctl.roomy([dst], live, rows) == [dst]
            assert roomy or not planned, f"{src}->{dst} T={T}: roomy dropped a switch the planner plans"
            dropped += not roomy
        # (withheld replica pages leave the pool's count: `withhold`)
        assert alloc.num_used == [sum(p >= 0 for s in live for p in s.pages[r]) for r in range(T)], \
            "planning and aborting leaked pages"
    # the random batches reach every verdict, so the agreement above means something
    assert verdicts >= {(True, None), (False, "eq5"), (False, "eq6"), (False, "owners")}, verdicts
    assert dropped, "no batch outgrew a layout's distinct pages: the pre-filter went untested"


def test_owners_refusal_names_the_pages_left():
    """Three CP requests of two one-token pages (one per rank) into DP, 4 pages per rank: the third
    fits nowhere once the first two own theirs, and the refusal shows the free pages left then
    (none), not those at the start."""
    alloc = KVAllocator(4, 1, world=2, layout="cp")
    engine = SimpleNamespace(allocator=alloc, scheduler=SimpleNamespace(
        running=[], waiting=[], cfg=SimpleNamespace(max_model_len=64)))
    ctl = SwitchController(engine, spec_for(2, "cp"))
    live = []
    for i in range(3):
        table = alloc.empty_table()
        alloc.grow(table, 2, 0)
        live.append(SimpleNamespace(seq_id=i, num_computed=2, num_tokens=2, owner=0, pages=table, slot=-1,
                                    params=SimpleNamespace(max_tokens=None), prompt_token_ids=[0, 0]))
    assert alloc.num_free == [1, 1] and not ctl.fits("dp", live)
    refusal = ctl._plan("dp", SimpleNamespace(seqs=[]), live, "overlapped")
    assert isinstance(refusal, SwitchRefusal) and refusal.reason == "owners"
    assert refusal.message.endswith("free pages beyond the reserve [0, 0]"), refusal.message


def test_stranded_counts_queued_requests_and_only_lost_reach():
    """CP on 2 ranks x 10 pages x 4 holds 80 tokens per request, TP/DP 40, DOP 40: a queued request
    whose limit is 60 strands in TP/DP/DOP (refused); one whose limit (500) is beyond every layout only
    counts as far as CP reaches, so from TP (reach 40) a switch into CP (80) is fine, back is not."""
    def ctl_for(layout: str, need: int) -> SwitchController:
        alloc = KVAllocator(10, 4, world=2, layout=layout)
        waiting = [SimpleNamespace(seq_id=7, num_computed=0, num_tokens=need - 5, owner=0, pages=[],
                                   params=SimpleNamespace(max_tokens=5), prompt_token_ids=[0] * (need - 5))]
        engine = SimpleNamespace(allocator=alloc, scheduler=SimpleNamespace(
            running=[], waiting=waiting, cfg=SimpleNamespace(max_model_len=4096)))
        return SwitchController(engine, spec_for(2, layout))

    ctl = ctl_for("cp", 60)
    for dst in ("tp", "dp", "dop"):
        want = f"waiting request 7 reaches 60 tokens at its limit; one request holds at most 40 in {dst}"
        assert ctl.stranded(dst, []) == want
        assert not ctl.fits(dst, [])
    assert ctl_for("cp", 500).stranded("tp", []) is not None
    ctl = ctl_for("tp", 500)
    assert ctl.stranded("cp", []) is None and ctl.stranded("dp", []) is None  # reach 40 -> 80 / 40
    ctl = ctl_for("tp", 30)
    assert all(ctl.stranded(dst, []) is None for dst in ("dp", "cp", "dop"))


def test_holds_pages_reads_every_row_whatever_the_owner_hint():
    """`holds_pages` looks at the owner's row first (the common case), but a page anywhere counts and
    a wrong or out-of-range hint changes nothing."""
    from splash.switch.controller import holds_pages

    cases = [([[-1, -1], [-1, 3]], True), ([[-1, 5, -1], [-1, -1, -1]], True), ([[4], [-1]], True),
             ([[-1, -1], [-1, -1]], False), ([[], []], False)]
    for pages, held in cases:
        for owner in (0, 1, 7, -1):
            assert holds_pages(pages, owner) is held, (pages, owner)
