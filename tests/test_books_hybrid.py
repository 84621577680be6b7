"""The books of a KDA hybrid's prefix cache (splash/kv/snapshots.py) under random events: a Hypothesis
state machine over admit / hit / evict / switch / update / preempt / abort / flush / pause / release, on
a real engine (scheduler, allocator, prefix cache with its snapshot pool, switch planner at T = 2) over
a fake runner that keeps, besides the paged KV store, each state row as what a KDA state is: the
history it absorbed, per (rank, row, head), placed as `held_state` places it.

The model: a sliced request's state holds exactly the (token, weight version) items its pages hold
before the slice, on exactly the (rank, head) blocks its layout and owner say; so a snapshot loaded from
the wrong row, saved at the wrong point, read after a weight update, lost or misplaced by a switch
(`state_moves` / `state_keep`), or a slot shared by two requests is caught. Besides: outputs equal the
rule's, no stale cached page is read, the books (pages, slots, snapshot rows) balance after every step
and operation, and once idle and flushed every page, slot and snapshot row is free.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import PagedFakeRunner
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_books import FAST, PROMPTS, Books, FakeRL, P, fake_engine
from test_books import ref as rule_ref

from splash.core.holdings import held_state
from splash.core.layouts import Layout
from splash.core.presets import PRESETS
from splash.engine.sampling import SamplingParams

MODEL = PRESETS["tiny-hybrid"]
HEADS = MODEL.linear_num_heads


class StatefulFakeRunner(PagedFakeRunner):
    """PagedFakeRunner plus state rows: `state[(rank, row, head)]` = the items the row absorbed."""

    def __init__(self, world: int, page_size: int, layout: str) -> None:
        super().__init__(world, page_size)
        self.layout = layout
        self.state: dict[tuple[int, int, int], tuple] = {}
        self.state_errors: list[str] = []

    def _row(self, row: int) -> dict[tuple[int, int], tuple]:
        return {(r, h): v for (r, x, h), v in self.state.items() if x == row}

    def _set_row(self, row: int, blocks: dict[tuple[int, int], tuple]) -> None:
        for k in [k for k in self.state if k[1] == row]:
            del self.state[k]
        self.state.update({(r, row, h): v for (r, h), v in blocks.items()})

    def copy_state(self, pairs: list[tuple[int, int]]) -> None:
        """Row copies in order, the same on every rank (what StatePool.copy_slots does)."""
        for src, dst in pairs:
            self._set_row(dst, self._row(src))

    def _switch(self, plan) -> None:
        """The executor's state all-to-all: received blocks from their senders, kept blocks stay,
        everything else is gone."""
        new = {}
        moves = plan.state_moves if plan.state_moves is not None else np.zeros((0, 4), dtype=np.int64)
        for slot, h, s, d in moves.tolist():
            if (s, slot, h) in self.state:  # (a slot admitted this step has no state yet: the
                new[(d, slot, h)] = self.state[(s, slot, h)]  # executor moves its zeros)
        for r, keep in enumerate(plan.state_keep):
            for slot, h in keep.tolist():
                if (r, slot, h) in self.state:
                    new[(r, slot, h)] = self.state[(r, slot, h)]
        self.state = new
        self.layout = plan.dst

    def execute(self, plan):
        if plan.kind == "switch":
            self._switch(plan.payload)
        out = super().execute(plan)
        for sl in plan.seqs:  # (positions before a slice's start are not written by its step)
            if sl.slot < 0:
                continue
            before = self._items(sl, sl.start)
            want = held_state(Layout(self.layout), np.array([sl.owner]), self.world, HEADS)[:, 0, :]
            blocks = {(int(r), int(h)) for r, h in zip(*np.nonzero(want))}
            if sl.start == 0:  # a fresh state (the runner zeroes a slot admitted at position 0)
                self._set_row(sl.slot, {b: () for b in blocks})
            row = self._row(sl.slot)
            vals = set(row.values())
            where = f"step {self.steps} request {sl.req_id} slot {sl.slot} ({self.layout})"
            if set(row) != blocks:
                self.state_errors.append(f"{where}: state on {sorted(row)}, the layout says {sorted(blocks)}")
            if len(vals) > 1:
                self.state_errors.append(f"{where}: ranks/heads disagree on the state")
            if vals and next(iter(vals)) != before:
                self.state_errors.append(f"{where}: state {next(iter(vals))} is not the first {sl.start} "
                                         f"items of its pages {before}")
            self._set_row(sl.slot, {b: self._items(sl, sl.end) for b in blocks})
        return out

    def _items(self, sl, n: int) -> tuple:
        table = [list(row) for row in sl.pages]
        return tuple(self._read(table, p) for p in range(n))


def hybrid_engine(world: int, pages: int = 20, weight_pages: int = 0, snapshots: int = 3) -> FakeRL:
    """fake_engine's engine on the hybrid preset over the stateful runner: a state slot per sequence,
    `snapshots` snapshot rows (few: the LRU evicts)."""
    return fake_engine(world, pages=pages, weight_pages=weight_pages, model=MODEL,
                       runner=StatefulFakeRunner(world, P, "tp"), snapshots=snapshots)


def _run(eng, prompts: list[list[int]], max_tokens: int = 4) -> dict[str, list[int]]:
    done = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", prompt_token_ids=p, params=SamplingParams(temperature=0.0, ignore_eos=True,
                                                                             max_tokens=max_tokens))
        while eng.has_unfinished():  # one at a time: each later prompt may hit the earlier ones
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    return done


def test_hits_are_exact_and_a_wrong_snapshot_is_caught(monkeypatch):
    """The fake's state check can fail: with the cache's loads sent one row off, the hitting request's
    state is not its prefix's, and the runner says so."""
    eng = hybrid_engine(1)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    done = _run(eng, prompts)
    assert [done[f"q{i}"] for i in range(3)] == [rule_ref(p, 4) for p in prompts]
    assert eng.stats()["prefix_snapshot_hits"] >= 2 and eng.runner.state_errors == []

    bad = hybrid_engine(1)
    _run(bad, [PROMPTS[3]])  # (a snapshot in the first row, another prompt's)
    real = bad.allocator.cache.snaps.load

    def load(block, slot):
        real(block, slot)
        src, dst = bad.allocator.cache.snaps.pending[-1]
        bad.allocator.cache.snaps.pending[-1] = (src + 1 if src + 1 < 6 + 3 else 6, dst)

    monkeypatch.setattr(bad.allocator.cache.snaps, "load", load)
    _run(bad, [PROMPTS[0], PROMPTS[1]])
    assert any("is not the first" in e or "the layout says" in e for e in bad.runner.state_errors)


def test_state_follows_all_12_switch_directions():
    """Every direction in turn with a request mid-decode and a snapshot held: the state blocks land
    where the destination layout places them (a switch that left them behind is caught)."""
    from test_engine_switch import CIRCUIT

    B = PROMPTS[4] + [50, 51]  # (its cacheable part ends where A's snapshot is: position 16)
    eng = hybrid_engine(2, pages=40)
    g = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
    eng.add_request("a", prompt_token_ids=PROMPTS[4], params=g)
    for _ in range(3):
        eng.step()
    done = {}
    for dst in CIRCUIT[1:]:
        eng.switcher.request(dst)
        eng.step()
        assert eng.switcher.alloc.layout == dst, dst
        assert eng.runner.state_errors == [], (dst, eng.runner.state_errors)
        eng.add_request(f"b{dst}{eng.steps}", prompt_token_ids=B, params=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=1))  # (hits A's held snapshot, in `dst`)
        eng.step()
    while eng.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert eng.runner.state_errors == [] and eng.scheduler.book_errors() == []
    assert done["a"] == rule_ref(PROMPTS[4], 40)
    assert all(v == rule_ref(B, 1) for k, v in done.items() if k != "a")
    st = eng.stats()
    assert st["prefix_snapshots_moved"] >= 12 and st["prefix_snapshot_hits"] >= 12, st


def test_a_switch_that_leaves_state_behind_is_caught(monkeypatch):
    """The check can fail: a switch whose state moves are not applied leaves a decoding request's state
    where the old layout placed it."""
    monkeypatch.setattr(StatefulFakeRunner, "_switch", lambda self, plan: setattr(self, "layout", plan.dst))
    eng = hybrid_engine(2, pages=40)
    eng.add_request("a", prompt_token_ids=PROMPTS[4], params=SamplingParams(temperature=0.0, max_tokens=9))
    for _ in range(3):
        eng.step()
    eng.switcher.request("dp")
    eng.step()
    assert any("the layout says" in e for e in eng.runner.state_errors), eng.runner.state_errors


def test_a_switch_over_prefix_pages_shared_out_of_order_is_refused_not_failed():
    """Found by the machine below: a hybrid's match is cut back to the block with a snapshot, so a
    request computes the blocks past it privately while another request registered them; a third that
    matches the whole chain then holds pages of two requests, in an order the switch planner cannot lay
    out. The switch is refused (reason "shared"), nothing fails, and the requests finish right."""
    eng = hybrid_engine(2, pages=20)
    n, want, done = 0, {}, {}

    def step() -> None:
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})

    def wave(picks: list[int], k: int) -> None:
        nonlocal n
        for i in picks:
            want[f"r{n}"] = rule_ref(PROMPTS[i], 6)
            eng.add_request(f"r{n}", prompt_token_ids=PROMPTS[i], params=SamplingParams(
                temperature=0.0, ignore_eos=True, max_tokens=6))
            n += 1
        for _ in range(k):
            step()

    wave([0, 0, 0, 0], 1)
    for rid in ("r0", "r1", "r2"):
        eng.abort(rid)
        want.pop(rid)
    wave([0, 0, 0], 1)
    eng.abort("r3")
    want.pop("r3")
    for picks, k in (([0, 0], 1), ([0, 5], 1)):
        wave(picks, k)
    eng.switcher.request("dp")
    step()
    wave([0, 0], 2)
    wave([0, 5], 1)
    eng.switcher.request("tp")
    step()
    refused = [e for e in eng.switcher.events if e.refused is not None]
    assert [(e.dst, e.refused) for e in refused] == [("tp", "shared")], eng.switcher.events
    while eng.has_unfinished():
        step()
    assert done == want and eng.runner.state_errors == [] and eng.scheduler.book_errors() == []


class HybridBooks(Books):
    """Books' events on the hybrid engine; the state check after every rule besides."""

    world = 1

    # (a tight pool preempts; a roomy one lets switches happen with requests in flight, which a tight
    # one mostly refuses for want of destination pages)
    @initialize(weight_pages=st.sampled_from([0, 2]), pages=st.sampled_from([20, 64]))
    def build(self, weight_pages: int, pages: int) -> None:
        self.eng = hybrid_engine(self.world, pages=pages, weight_pages=weight_pages)
        self.prompts: dict[str, list[int]] = {}
        self.n = 0

    # (Hypothesis's runs are mostly short: these rules pack the events worth having in flight together)
    @rule(picks=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=2, max_size=4), k=st.integers(1, 3))
    def wave(self, picks: list[int], k: int) -> None:
        """Several prompts at once (hits on each other's prefixes), a few steps."""
        for i in picks:
            self.add(i, 1, 6)
        self.step(k)

    @precondition(lambda self: self.world > 1)
    @rule(dst=st.sampled_from(["tp", "dp", "cp", "dop"]), k=st.integers(1, 3))
    def switch_now(self, dst: str, k: int) -> None:
        """A switch executed at once, with whatever is in flight."""
        self.eng.switcher.request(dst)
        self.step(k)

    @invariant()
    def state_matches_pages(self) -> None:
        if hasattr(self, "eng"):
            assert self.eng.runner.state_errors == [], self.eng.runner.state_errors[:3]

    def teardown(self) -> None:
        super().teardown()
        if hasattr(self, "eng"):
            assert self.eng.runner.state_errors == []
            assert self.eng.allocator.slots.num_free == 6
            assert self.eng.allocator.cache.snaps.num_used == 0


class HybridBooksT2(HybridBooks):
    world = 2


TestHybridBooksT1 = HybridBooks.TestCase
TestHybridBooksT1.settings = settings(FAST, max_examples=200)  # (most runs are short: ~10 ms each)
TestHybridBooksT2 = pytest.mark.slow(HybridBooksT2.TestCase)
TestHybridBooksT2.settings = settings(FAST, max_examples=200)
