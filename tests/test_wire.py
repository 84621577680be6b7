"""Step messages as deltas (splash/step/wire.py) and the ranks' own tables (splash/step/tables.py).

No ranks here: rank 0's allocator grows and frees tables as the scheduler would (prefill chunks,
decode, preemption, finishing, a switch replacing every table), each plan goes through encode ->
bytes -> decode, and one RankTables per rank applies the deltas. Checked after every step: every
rank's tables equal rank 0's full tables, nothing stale is kept, the decoded slices and rows equal the
plan's, a ForwardContext built from the stored tables equals one built from the plan's own lists, and
a decode step's message has a fixed size per request whatever the context length.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from splash.attention.local import LocalLayout
from splash.kv.allocator import KVAllocator
from splash.step import wire
from splash.step.plan import SeqSlice, StepPlan
from splash.step.tables import RankTables
from splash.worker.context import build_context

P = 4


class Mirror:
    """Rank 0 (allocator + encoder) and T ranks' stored tables, driven step by step."""

    def __init__(self, world: int, layout: str, pages: int = 400) -> None:
        self.alloc = KVAllocator(pages, P, world=world, layout=layout)
        self.enc = wire.PlanEncoder(world)
        self.ranks = [RankTables(rows=2, width=2) for _ in range(world)]  # tiny: growth is exercised
        self.tables: dict[int, list[list[int]]] = {}  # rank 0's live tables
        self.done: dict[int, int] = {}  # req_id -> tokens in cache
        self.owner: dict[int, int] = {}
        self.dropped: list[int] = []
        self.step = 0

    def drop(self, rid: int) -> None:
        self.alloc.release(self.tables.pop(rid))
        self.done.pop(rid)
        self.dropped.append(rid)

    def plan(self, rows: dict[int, int], kind: str = "forward", tables=None, sample=None) -> StepPlan:
        seqs, ids = [], []
        for rid, k in rows.items():
            t = self.tables.setdefault(rid, self.alloc.empty_table())
            start = self.done.setdefault(rid, 0)
            self.alloc.grow(t, start + k, self.owner.setdefault(rid, rid % self.alloc.world))
            s = bool(sample[rid]) if sample else True
            seqs.append(SeqSlice(rid, start, k, self.owner[rid], [row[:] for row in t], s))
            ids += [(rid * 7 + start + i) % 1000 for i in range(k)]
        plan = StepPlan(self.step, self.alloc.layout, ids, seqs, kind=kind, dropped=self.dropped,
                        tables=tables)
        self.dropped = []
        self.step += 1
        return plan

    def send(self, plan: StepPlan, msg=None) -> tuple[StepPlan, int]:
        msg = self.enc.encode(plan) if msg is None else msg
        nbytes = len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        got = wire.decode(pickle.loads(pickle.dumps(msg)))
        for r, tabs in enumerate(self.ranks):
            got.delta.apply(tabs, r)
        for s in plan.seqs:
            self.done[s.req_id] = s.end
        return got, nbytes

    def check(self, plan: StepPlan, got: StepPlan) -> None:
        assert (got.step, got.layout, got.kind) == (plan.step, plan.layout, plan.kind)
        assert list(got.input_ids) == list(plan.input_ids)
        assert [(s.req_id, s.start, s.num_new, s.owner, s.sample) for s in got.seqs] == \
            [(s.req_id, s.start, s.num_new, s.owner, s.sample) for s in plan.seqs]
        assert got.sample_rows() == plan.sample_rows() and got.positions() == plan.positions()
        for r, tabs in enumerate(self.ranks):
            assert tabs.snapshot() == {rid: t[r] for rid, t in self.tables.items()}, f"rank {r}"
        assert set(self.enc.known) == set(self.tables)
        for r in range(len(self.ranks)):  # the step's context: stored tables == the plan's lists
            a = build_context(plan.seqs, kv=None, layout=LocalLayout(), rank=r, page_size=P)
            b = build_context(got.seqs, kv=None, layout=LocalLayout(), rank=r, page_size=P,
                                     tables=self.ranks[r])
            for f in ("positions", "write_rows", "write_slots", "page_table"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (r, f)
            assert (a.all_held, a.max_end) == (b.all_held, b.max_end)
            for sa, sb in zip(a.seqs, b.seqs):
                assert torch.equal(sa.pages, sb.pages) and sa.rows == sb.rows
                assert all(torch.equal(x, y) for x, y in zip(sa.key_slots(), sb.key_slots()))


@pytest.mark.parametrize("world,layout", [(1, "tp"), (2, "tp"), (3, "dp"), (4, "cp"), (2, "dop")])
def test_deltas_reproduce_full_tables(world, layout):
    """Prefill in chunks, decode, preemption (drop + recompute under the same id), finish, abort."""
    m = Mirror(world, layout)
    rng = random.Random(world * 10 + len(layout))
    prompt = {rid: rng.randrange(1, 30) for rid in range(6)}
    for step in range(60):
        rows = {}
        for rid in list(m.tables) + [r for r in prompt if r not in m.tables and r not in m.done]:
            left = prompt[rid] - m.done.get(rid, 0)
            rows[rid] = min(left, rng.randrange(1, 9)) if left > 1 else 1
        if step % 13 == 7 and m.tables:  # preempt one: its table goes, it comes back from scratch
            victim = rng.choice(sorted(m.tables))
            m.drop(victim)
            rows.pop(victim, None)
        if step == 30:  # abort / finish two
            for rid in sorted(m.tables)[:2]:
                m.drop(rid)
                rows.pop(rid, None)
                prompt.pop(rid)
        if not rows:
            continue
        plan = m.plan(rows, sample={r: m.done.get(r, 0) + k >= prompt[r] for r, k in rows.items()})
        got, _ = m.send(plan)
        m.check(plan, got)
    for rid in list(m.tables):
        m.drop(rid)
    plan = m.plan({99: 3})
    got, _ = m.send(plan)
    m.check(plan, got)
    assert all(t.ids() == [99] for t in m.ranks), "finished requests' tables were kept"


@pytest.mark.parametrize("world,src,dst", [(2, "tp", "dp"), (2, "dp", "cp"), (4, "cp", "dop"),
                                           (4, "dop", "tp")])
def test_switch_replaces_every_table_once(world, src, dst):
    """A switching step ships every live request's new table (also those without rows in the step),
    drops requests that are not live any more, and later steps send only growth again."""
    m = Mirror(world, src)
    for rid in range(5):
        plan = m.plan({rid: 9 + rid})
        m.check(plan, m.send(plan)[0])
    # rank 0 re-places every table in dst (a stand-in for the planner: same lengths, new pages)
    new_alloc = KVAllocator(400, P, world=world, layout=dst)
    m.drop(4)
    new = {}
    for rid, t in m.tables.items():
        n = new_alloc.empty_table()
        new_alloc.grow(n, len(t[0]) * P, rid % world)
        new[rid] = n
    for t in m.tables.values():
        m.alloc.release(t)
    m.alloc, m.tables = new_alloc, {rid: [row[:] for row in t] for rid, t in new.items()}
    seqs = [SeqSlice(0, m.done[0], 1, 0, [row[:] for row in m.tables[0]], True)]
    assert m.done[0] < len(m.tables[0][0]) * P  # req 0 decodes in the switching step, in its last page
    plan = StepPlan(m.step, dst, [5], seqs, kind="switch", payload={"sw": 1}, dropped=m.dropped,
                    tables=new)
    m.dropped = []
    m.step += 1
    msg = m.enc.encode(plan)
    assert isinstance(msg, tuple) and msg[1:] == ("switch", {"sw": 1})
    got, _ = m.send(plan, msg)
    m.check(plan, got)
    assert got.payload == {"sw": 1}
    plan = m.plan({0: 1, 1: 1, 2: 1, 3: 1})
    _, nbytes = m.send(plan)
    assert nbytes < 200, "after the switch only growth travels"
    plan = m.plan({0: 1, 3: 6})
    m.check(plan, m.send(plan)[0])


def test_decode_message_size_is_per_request_not_per_page():
    """B=32 decode at T=4: the same bytes at 100 or 2000 tokens of context, <= 128 B/request + 4 KiB."""
    sizes = {}
    for ctx in (100, 2000):
        m = Mirror(4, "dp", pages=5000)
        for rid in range(32):
            m.send(m.plan({rid: ctx}))
        m.send(m.plan({rid: 1 for rid in range(32)}))  # may cross a page boundary
        plan = m.plan({rid: 1 for rid in range(32)})
        grown = sum(len(s.pages[0]) > m.enc.known[s.req_id] for s in plan.seqs)
        got, nbytes = m.send(plan)
        m.check(plan, got)
        assert grown == 0 or ctx % P
        sizes[ctx] = nbytes
        assert m.enc.decode_bytes_p50() == nbytes == m.enc.last_size
    assert sizes[100] == sizes[2000] <= 128 * 32 + 4096
    assert sizes[100] < 32 * 20 + 80  # req_id 8 + start 4 + token 4 + owner 1 per request, 40 B header


def test_median_and_bad_input():
    from collections import Counter

    assert wire.median(Counter()) is None
    assert wire.median(Counter({5: 1, 9: 1, 100: 1})) == 9
    assert wire.median(Counter({5: 2, 9: 2})) == 5
    m = Mirror(2, "tp")
    m.send(m.plan({1: 9}))
    # a table whose tail was returned (a speculative step's rejected rows): the ranks drop it and take
    # it whole again; in a switch step (tables replaced) that cannot happen and is refused
    shrunk = StepPlan(9, "tp", [1], [SeqSlice(1, 1, 1, 0, [[3], [3]], True)])
    m.send(shrunk)
    assert [tabs.row(1) for tabs in m.ranks] == [[3], [3]]
    bad = StepPlan(10, "tp", [1], [SeqSlice(1, 1, 1, 0, [[3], [3]], True)], kind="switch",
                   tables={1: [[3, 4], [3, 4]]})
    with pytest.raises(RuntimeError, match="shrank"):
        m.enc.encode(bad)
    with pytest.raises(ValueError, match="page tables for 1 ranks"):
        m.enc.encode(StepPlan(9, "tp", [1], [SeqSlice(2, 0, 1, 0, [[3]], True)]))
    t = RankTables()
    t.append(7, np.array([4, 5]))
    sl = SeqSlice(7, 8, 2, 0, [], True)  # needs 3 pages, holds 2
    with pytest.raises(RuntimeError, match="request 7 has 2 pages"):
        build_context([sl], kv=None, layout=LocalLayout(), page_size=P, tables=t)
    with pytest.raises(KeyError, match="request 8 has no page table"):
        build_context([SeqSlice(8, 0, 1, 0, [], True)], kv=None, layout=LocalLayout(), page_size=P,
                             tables=t)
