"""The books (splash/kv/books.py) and the events that move pages: weight updates with requests in flight,
flush, memory release, abort, preemption, pause, live switches, failed steps.

Three kinds of check: the checker itself catches each kind of corruption (so it can fail); the root
cause of the soak's double free (shared prefix pages held across a weight update) and its neighbours,
at the allocator; and a Hypothesis state machine that drives a real engine (scheduler, allocator,
prefix cache, switch planner at T = 2) on a paged fake runner through random sequences of every event,
against a simple model: every finished request's tokens equal the rule's on its true history (a page
given to two requests or moved wrongly changes them), no request reads a cached page computed before
its admission's weights, the books balance after every step and operation (the engine's own debug
check is on), and once idle and flushed every page and slot is free.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_fakes import PagedFakeRunner, fake_spec, next_token
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from splash.engine.llm_engine import LLMEngine, StepFailed
from splash.engine.sampling import SamplingParams
from splash.engine.weights import WeightOp
from splash.kv.allocator import KVAllocator
from splash.kv.books import BooksError, Holder, book_errors

P = 4


# ---- the checker can fail ------------------------------------------------------------------------------
def _two_sharing(world: int = 1):
    """An allocator with the prefix cache, table a (13 tokens, 3 full pages registered and ready) and
    table b sharing those 3 pages plus one of its own."""
    alloc = KVAllocator(12, P, world=world)
    cache = alloc.enable_prefix_cache()
    keys = cache.keys(list(range(13)), 3)
    a = alloc.empty_table()
    alloc.grow(a, 13, 0)
    blocks = [cache.register(k, j, [row[j] for row in a]) for j, k in enumerate(keys)]
    for b in blocks:
        b.ready = True
    got, _ = cache.match(keys)
    cache.take(got)
    b = [[x.column[r] for x in got] for r in range(world)]
    alloc.grow(b, 14, 0)
    holders = {1: Holder(a, 0, -1, blocks), 2: Holder(b, 0, -1, list(got))}
    return alloc, cache, a, b, holders


def test_books_balance_and_each_corruption_is_caught():
    alloc, cache, a, b, holders = _two_sharing()
    assert book_errors(alloc, holders) == []
    # a held page also on the free list (a run of one page at it)
    r0 = alloc.ranks[0]
    r0._start[a[0][3]] = 1
    assert any("both free and held" in e for e in book_errors(alloc, holders))
    assert any("counted free" in e for e in book_errors(alloc, holders))
    del r0._start[a[0][3]]
    # a private page leaked (its table forgot it)
    lost = b[0].pop()
    assert any("leaked" in e for e in book_errors(alloc, holders))
    b[0].append(lost)
    # a private page in two tables
    b[0][3] = a[0][3]
    assert any("by no prefix block" in e for e in book_errors(alloc, holders))
    b[0][3] = lost
    # a shared page whose block counts one holder too many
    got = holders[1].blocks[0]
    got.refs += 1
    assert any("its block counts 3" in e for e in book_errors(alloc, holders))
    got.refs -= 1
    # a table that does not sit where its block says
    holders[2].blocks = [None, *holders[2].blocks[:1]]
    assert any("its block says" in e for e in book_errors(alloc, holders))
    holders[2].blocks = list(holders[1].blocks)
    # state slots: a slot held twice
    from splash.kv.slots import SlotAllocator

    alloc.slots = SlotAllocator(4)
    s = alloc.slots.alloc()
    holders[1].slot = holders[2].slot = s
    assert any("held by two" in e for e in book_errors(alloc, holders))
    holders[2].slot = alloc.slots.alloc()
    assert book_errors(alloc, holders) == []


def test_invalidate_frees_shared_pages_once():
    """The soak's double free: a weight update while two tables share prefix pages. The blocks leave
    the index at once (nothing matches them), stay counted, and go back with their last holder."""
    alloc, cache, a, b, holders = _two_sharing()
    keys = cache.keys(list(range(13)), 3)
    alloc.invalidate_cache()
    assert cache.match(keys) == ([], False) and not cache.blocks
    assert book_errors(alloc, holders) == []
    # a new prompt with the same tokens registers fresh blocks beside the stale ones
    c = alloc.empty_table()
    alloc.grow(c, 13, 0)
    fresh = [cache.register(k, j, [row[j] for row in c]) for j, k in enumerate(keys)]
    assert all(f is not None for f in fresh)
    holders[3] = Holder(c, 0, -1, fresh)
    assert book_errors(alloc, holders) == []
    alloc.release(a)
    del holders[1]
    assert book_errors(alloc, holders) == []
    alloc.release(b)  # the last holder of the stale blocks: their pages are freed here, once
    del holders[2]
    assert book_errors(alloc, holders) == [] and alloc.num_used == [4]
    for f in fresh:
        f.ready = True
    alloc.release(c)
    assert alloc.num_used == [0] and cache.evictable() == [3]
    alloc.evict_all()
    assert alloc.ranks[0].num_free == 12


def test_stale_blocks_follow_a_switch():
    """Stale blocks move with their holders (their pages would otherwise leak or be freed twice); a
    block the switch does not account for is a bookkeeping bug, raised before anything changes."""
    alloc, cache, a, b, holders = _two_sharing(world=2)
    alloc.invalidate_cache()
    shift = [[p + 100 if p >= 0 else p for p in row] for row in a]
    alloc.cache_moved({1: a}, {1: shift})
    assert sorted(x.column for x in cache.live_blocks()) == sorted(tuple(row[j] for row in shift)
                                                                   for j in range(3))
    assert all(not x.indexed and x.refs == 2 for x in cache.live_blocks())
    c = alloc.empty_table()
    alloc.grow(c, 5, 0)
    cache.register(b"k", 0, [row[0] for row in c])
    before = [x.column for x in cache.live_blocks()]
    with pytest.raises(RuntimeError, match="lost the pages"):
        alloc.cache_moved({1: shift}, {1: a})  # (c's block would not move with it: refused whole)
    assert [x.column for x in cache.live_blocks()] == before


# ---- a fake engine on a paged store ----------------------------------------------------------------------
class FakeRL(LLMEngine):
    """The engine with its ranks' side of weight operations played by the paged fake: an update bumps the
    fake's weight version, a KV release wipes its pool (what the ranks do to their tensors)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rl._run = self._run  # (the RL part sends its operations to the fake ranks)

    def _run(self, op: WeightOp) -> None:
        if op.kind in ("disk", "tensors", "dist"):
            self.runner.version += 1
        elif op.kind == "release" and "kv_cache" in op.args["tags"]:
            self.runner.kv.clear()

    def update_weights(self) -> None:
        """What update_weights_from_* do once the ranks agreed (the checks of names are the model's)."""
        self.rl._check_weights_live()
        self._run(WeightOp("tensors"))
        self.rl._after_update(None)


def fake_engine(world: int, pages: int = 20, max_num_seqs: int = 6, budget: int = 12,
                weight_pages: int = 0, layout: str = "tp", model=None, runner=None,
                snapshots: int | None = None) -> FakeRL:
    """A fake engine on a paged store with the prefix cache, the books check and memory release on.
    `model`: its shape (default tiny); `runner`: default a PagedFakeRunner; `snapshots`: a KDA
    hybrid's state slots (one per sequence) and that many prefix snapshot rows."""
    alloc = KVAllocator(pages, P, world=world, layout=layout)
    cache = alloc.enable_prefix_cache()
    if snapshots is not None:
        from splash.kv.slots import SlotAllocator
        from splash.kv.snapshots import SnapshotPool

        alloc.slots = SlotAllocator(max_num_seqs)
        cache.snaps = SnapshotPool(max_num_seqs, snapshots)
    spec = fake_spec(model, world=world, layout=layout, dtype=torch.float64, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=64, page_size=P)
    # (T > 1: the engine builds its switch controller, the replicas' pages withheld as given)
    eng = FakeRL(spec, runner or PagedFakeRunner(world, P), alloc, weight_pages=[weight_pages] * world)
    eng.check_books = True
    eng.memory_saver = True
    return eng


def ref(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


BASE = list(range(20, 33))  # 13 tokens: 3 full pages to share
PROMPTS = [BASE + [3], BASE + [4, 5], BASE[:9] + [6], list(range(40, 46)), BASE + [3, 7, 8, 9, 10]]
# a next turn: the first prompt and its own answer resent (it hits pages that answer generated)
PROMPTS.append(PROMPTS[0] + ref(PROMPTS[0], 6) + [11])


def test_no_hit_on_pages_an_update_left_behind():
    """A request in flight across a weight update keeps its pages, but the pages it completes afterwards
    attend to old-weight KV: they are never offered to the cache. Here the next turn of a conversation
    would otherwise hit a page the first turn finished after the update (positions 12, 13 computed before
    it) behind a fresh prefix of the same tokens."""
    g = lambda m: SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m)  # noqa: E731
    eng = fake_engine(1)
    eng.add_request("first", prompt_token_ids=PROMPTS[0], params=g(10))
    eng.step()
    eng.step()
    eng.update_weights()
    for _ in range(4):
        eng.step()
    eng.add_request("again", prompt_token_ids=PROMPTS[0], params=g(1))  # fresh pages 0-2, new weights
    for _ in range(3):
        eng.step()
    eng.add_request("next-turn", prompt_token_ids=PROMPTS[5], params=g(2))
    while eng.has_unfinished():
        eng.step()
    assert eng.runner.stale_reads == []
    assert eng.stats()["prefix_cache_hits"] == 12  # the fresh 3 pages, nothing of the in-flight one


class Books(RuleBasedStateMachine):
    """Random sequences of every event on a fake engine; the model: outputs equal the rule's, no stale
    cached read, the books balance (checked by the engine after every step and operation), and the pool
    empties once idle and flushed."""

    world = 1

    @initialize(weight_pages=st.sampled_from([0, 2]))
    def build(self, weight_pages: int) -> None:
        self.eng = fake_engine(self.world, weight_pages=weight_pages)
        self.prompts: dict[str, list[int]] = {}
        self.n = 0

    @property
    def live(self) -> list[str]:
        return sorted(self.eng.requests)

    def _check(self, outs) -> None:
        for o in outs:
            if not o.finished:
                continue
            for c in o.outputs:
                if c.finish_reason == "abort":
                    continue
                assert c.token_ids == ref(self.prompts[o.request_id], len(c.token_ids)), o.request_id
                assert c.finish_reason == "length"

    @rule(i=st.integers(0, len(PROMPTS) - 1), n=st.integers(1, 2), max_tokens=st.integers(1, 10))
    def add(self, i: int, n: int, max_tokens: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        self.prompts[rid] = PROMPTS[i]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, n=n)
        self.eng.add_request(rid, prompt_token_ids=PROMPTS[i], params=params)

    @rule(k=st.integers(1, 4))
    def step(self, k: int) -> None:
        for _ in range(k):
            self._check(self.eng.step())

    @precondition(lambda self: self.eng.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(self.live))
        self._check([self.eng.abort(rid)])

    @rule()
    def abort_all(self) -> None:
        self._check(self.eng.abort_all())

    @precondition(lambda self: "weights" not in self.eng.rl._released)
    @rule()
    def update_weights(self) -> None:
        self.eng.update_weights()

    @rule()
    def flush(self) -> None:
        if self.eng.scheduler.running:
            with pytest.raises(ValueError, match="hold KV"):
                self.eng.flush_cache()
        else:
            self.eng.flush_cache()

    @precondition(lambda self: not self.eng.is_paused)
    @rule(mode=st.sampled_from(["retract", "in_place", "abort"]))
    def pause(self, mode: str) -> None:
        self._check(self.eng.pause_generation(mode))

    @precondition(lambda self: "paused" in self.eng.rl._held)
    @rule()
    def resume(self) -> None:
        self.eng.continue_generation()

    @precondition(lambda self: not self.eng.rl._released)
    @rule()
    def release_kv(self) -> None:
        self.eng.release_memory_occupation(["kv_cache"])

    @precondition(lambda self: self.eng.rl._released)
    @rule()
    def resume_kv(self) -> None:
        self.eng.resume_memory_occupation(["kv_cache"])

    @precondition(lambda self: self.world > 1)
    @rule(dst=st.sampled_from(["tp", "dp", "cp", "dop"]))
    def switch(self, dst: str) -> None:
        self.eng.switcher.request(dst)

    @invariant()
    def books_balance(self) -> None:
        if hasattr(self, "eng"):
            assert self.eng.scheduler.book_errors() == []
            assert self.eng.runner.stale_reads == []

    def teardown(self) -> None:
        if not hasattr(self, "eng"):
            return
        eng = self.eng
        eng.continue_generation()
        if eng.rl._released:
            eng.resume_memory_occupation()
        for _ in range(200):  # everything still queued finishes, right
            if not eng.has_unfinished():
                break
            self._check(eng.step())
        assert not eng.has_unfinished()
        eng.flush_cache()
        assert eng.allocator.num_used == [0] * self.world
        assert all(a.num_free == a.num_pages for a in eng.allocator.ranks)
        assert eng.runner.stale_reads == []


class BooksT2(Books):
    world = 2


FAST = settings(max_examples=40, stateful_step_count=30, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBooksT1 = Books.TestCase
TestBooksT1.settings = FAST
TestBooksT2 = BooksT2.TestCase
TestBooksT2.settings = settings(FAST, max_examples=30)


# ---- a failed step ---------------------------------------------------------------------------------------
def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def test_a_failed_step_fails_its_requests_and_the_rest_go_on():
    eng = fake_engine(1, budget=4)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", prompt_token_ids=p, params=_greedy())
    eng.step()  # r0's first chunk only (budget 4)
    real = eng.runner.execute
    eng.runner.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(StepFailed) as e:
        eng.step()
    eng.runner.execute = real
    assert not e.value.fatal and [o.request_id for o in e.value.failed] == ["r0"]
    assert eng.failure() is None and eng.scheduler.book_errors() == []
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert sorted(done) == ["r1", "r2"]
    assert all(done[r].outputs[0].token_ids == ref(PROMPTS[i], 8) for i, r in ((1, "r1"), (2, "r2")))
    eng.flush_cache()
    assert eng.allocator.num_used == [0]


def test_unsound_books_after_a_failure_break_the_engine():
    """A step that leaves the books unbalanced (here: a page freed behind the engine's back) is caught at
    that step; every request ends, the engine is marked broken and refuses to step, and an AsyncEngine
    reports unhealthy (the server then exits non-zero)."""
    from splash.engine.async_engine import AsyncEngine, EngineError

    eng = fake_engine(1)
    eng.add_request("a", prompt_token_ids=PROMPTS[0], params=_greedy())
    eng.add_request("b", prompt_token_ids=PROMPTS[3], params=_greedy())
    eng.step()
    seq = eng.requests["a"].seqs[0]
    eng.allocator.ranks[0].free([seq.pages[0][-1]])  # the bug: a held page back on the free list
    with pytest.raises(StepFailed) as e:
        eng.step()
    assert e.value.fatal and {o.request_id for o in e.value.failed} == {"a", "b"}
    assert isinstance(e.value.__cause__, BooksError)
    assert eng.failure() is not None and not eng.requests
    with pytest.raises(RuntimeError, match="cannot step"):
        eng.step()

    async def main() -> None:
        bad = fake_engine(1)
        ae = AsyncEngine(bad)
        try:
            async def one(rid: str) -> None:
                freed = False
                async for _ in ae.generate(PROMPTS[3], _greedy(40), rid):
                    if not freed:  # (the engine thread finds it at the end of its next step)
                        ae.engine.allocator.ranks[0].free([ae.engine.requests[rid].seqs[0].pages[0][0]])
                        freed = True
            with pytest.raises(EngineError, match="books do not balance"):
                await one("x")
            for _ in range(50):
                if ae.dead is not None:
                    break
                await asyncio.sleep(0.02)
            assert not ae.is_healthy and ae.dead is not None
        finally:
            ae.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
