"""The prefix cache of KDA hybrids on one rank (splash/kv/snapshots.py): a cached prefix carries the KDA
state at its end, a request that hits it starts from a copy and prefills only the rest.

float64 throughout. Checked: greedy tokens equal transformers' (its KDA core in float64) and every
sampled row's logits equal the cache-off engine's to 1e-9, for full hits, partial hits (a snapshot
shorter than the match), hits cut back to a miss (pages cached, no snapshot there) and misses, in
waves and all at once; a control that drops the loads changes the tokens (the snapshot is what carries
the state); n samples compute their prompt once; preemption, abort, an LRU-evicted snapshot pool, a
weight update (no snapshot survives it) and n-gram speculation's KDA restore stay exact; the books
(with the snapshot rows) balance after every step (SPLASH_CHECK_BOOKS, tests/conftest.py).
"""

from __future__ import annotations

import pytest
from helpers_ckpt import hf_greedy
from helpers_kda import build_kimi, kda_core_float64, kimi_reference

from splash.core.model_config import ModelConfig
from splash.engine.build import build_engine
from splash.engine.resolve import prefix_cache_default
from splash.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 6
A = list(range(10, 31))  # 21 tokens: snapshot at 20 (page 4)
PROMPTS = [A, A + [3, 4, 5, 6, 7],  # a full hit at 20 (its own snapshot point is 24)
           A[:13] + [50, 51, 52],  # pages 0-2 cached, no snapshot at 12: cut back to a miss
           A[:13] + [60, 61, 62, 63, 64],  # a partial hit: the snapshot the one before took at 12
           [5, 6, 7], A]  # no full page: a miss; A again: a full hit
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, device="cpu", num_kv_pages=96)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(checkpoint, transformers' greedy tokens with its float64 KDA core)."""
    path = build_kimi(tmp_path_factory.mktemp("pkimi") / "k", seed=1)
    hf = kimi_reference(path)
    with kda_core_float64():
        ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, ref


def greedy(new: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": new, "ignore_eos": True, **kw})


def serve(eng, waves, params=None, on_step=None):
    """Serve `waves` (lists of (request id, prompt)), each drained before the next: {id: [tokens per
    sample]}, {(id, sample, position): logits row}, prompt rows computed."""
    logits, rows = {}, [0]

    def hook(plan, seqs, out):
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], out):
            logits[(seq.group.request_id, seq.index, len(seq.output_token_ids))] = row.clone()
        rows[0] += sum(max(0, min(sl.end, len(seq.prompt_token_ids)) - sl.start)
                       for seq, sl in zip(seqs, plan.seqs))

    eng.logits_hook = hook
    done = {}
    for wave in waves:
        for rid, p in wave:
            eng.add_request(rid, prompt_token_ids=p, params=params or greedy())
        while eng.has_unfinished():
            if on_step is not None:
                on_step(eng)
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = [c.token_ids for c in o.outputs]
            errs = eng.scheduler.book_errors()
            assert not errs, errs
    eng.logits_hook = None
    return done, logits, rows[0]


def close(a, b) -> None:
    assert a.keys() == b.keys(), "sampled rows differ"
    err = max((a[k] - b[k]).abs().max().item() for k in a)
    assert err < 1e-9, f"logits differ from the cache-off engine by {err:.2e}"


def build(path, cache: bool, **kw):
    return build_engine(model=path, enable_prefix_caching=cache, **{**ENGINE, **kw})


def test_on_by_default_for_hybrids_off_when_asked(kimi):
    cfg = ModelConfig.from_hf(kimi[0])
    assert prefix_cache_default(cfg, None) is True and prefix_cache_default(cfg, False) is False
    for kw in ({}, {"num_state_snapshots": 3}, {"enable_prefix_caching": False}):
        eng = build_engine(model=kimi[0], **{**ENGINE, **kw})
        try:
            st = eng.stats()
            assert st["prefix_caching"] is (kw.get("enable_prefix_caching", True))
            assert st.get("prefix_snapshots_total") == (None if kw.get("enable_prefix_caching") is False
                                                        else kw.get("num_state_snapshots", 8))  # (= slots)
            assert eng.runner.state.num_slots == 8 + (st.get("prefix_snapshots_total") or 0)
        finally:
            eng.shutdown()


@pytest.fixture(scope="module")
def off(kimi):
    """The cache-off engine's tokens and logits, waves of one request each and all at once."""
    eng = build(kimi[0], False)
    try:
        waves = serve(eng, [[(str(i), p)] for i, p in enumerate(PROMPTS)])
        together = serve(eng, [[(str(i), p) for i, p in enumerate(PROMPTS)]])
    finally:
        eng.shutdown()
    return waves, together


def test_hits_partial_hits_and_misses_are_exact(kimi, off):
    path, ref = kimi
    eng = build(path, True)
    try:
        done, logits, rows = serve(eng, [[(str(i), p)] for i, p in enumerate(PROMPTS)])
        st = eng.stats()
    finally:
        eng.shutdown()
    assert [done[str(i)][0] for i in range(len(PROMPTS))] == ref
    close(logits, off[0][1])
    # hits: 20 (prompt 1), 12 (prompt 3, partial), 20 (prompt 5); misses: 0, 2 (cut back), 4
    assert st["prefix_snapshot_hits"] == 3 and st["prefix_cache_hits"] == 20 + 12 + 20
    assert st["prefix_snapshots_saved"] == 4  # at 20, 24, 12, 16 (none for [5, 6, 7], nor A's again)
    assert rows == off[0][2] - 52
    # and on /metrics, as the server exports the engine's stats
    from splash.server.metrics import ServerMetrics

    m = ServerMetrics("kimi")
    m.refresh(st)
    text = m.render().decode()
    assert 'splash:prefix_snapshot_hits_total{model_name="kimi"} 3.0' in text
    assert 'splash:prefix_snapshots_saved_total{model_name="kimi"} 4.0' in text
    assert f'splash:prefix_snapshots_used{{model_name="kimi"}} {float(st["prefix_snapshots_used"])}' in text
    assert f'splash:prefix_snapshots_total{{model_name="kimi"}} {float(st["prefix_snapshots_total"])}' in text


def test_all_at_once_and_a_control_without_the_loads(kimi, off, monkeypatch):
    """Requests arriving together wait for the prefix being computed, then hit; dropping the loads
    (the slot keeps a zeroed state) changes the hits' tokens: the snapshot is what carries the state."""
    path, ref = kimi
    eng = build(path, True)
    try:
        done, logits, _ = serve(eng, [[(str(i), p) for i, p in enumerate(PROMPTS)]])
        assert eng.stats()["prefix_snapshot_hits"] >= 2
    finally:
        eng.shutdown()
    assert [done[str(i)][0] for i in range(len(PROMPTS))] == ref
    close(logits, off[1][1])

    from splash.kv.state import StatePool

    copy = StatePool.copy_slots
    monkeypatch.setattr(StatePool, "copy_slots", lambda self, pairs: copy(
        self, [(s, d) for s, d in pairs if d >= self.num_slots - 8]))  # saves only: loads dropped
    eng = build(path, True)
    try:
        done, _, _ = serve(eng, [[(str(i), p)] for i, p in enumerate(PROMPTS)])
    finally:
        eng.shutdown()
    assert [done[str(i)][0] for i in (1, 3, 5)] != [ref[i] for i in (1, 3, 5)]


def test_n_samples_compute_the_prompt_once(kimi):
    path, _ = kimi
    prompt = A + [7, 7, 8, 9, 44, 45, 46]  # 28 tokens: snapshot at 24
    outs = {}
    for cache in (False, True):
        eng = build(path, cache)
        try:
            outs[cache] = serve(eng, [[("g", prompt)]], params=greedy(4, n=4))
        finally:
            eng.shutdown()
    (t0, l0, rows0), (t1, l1, rows1) = outs[False], outs[True]
    assert t0 == t1 and len(t1["g"]) == 4
    close(l1, l0)
    assert rows0 == 4 * 28 and rows1 == 28 + 3 * (28 - 24)


def test_preemption_abort_eviction_update_and_speculation(kimi, tmp_path):
    """A pool too small for everyone (preemption, requests readmitted through the cache), an abort
    mid-prefill, one snapshot row (LRU eviction), then a weight update: no snapshot survives it and
    the next requests get the new weights' tokens; n-gram drafts (the KDA verify restore) alongside."""
    from safetensors.torch import load_file

    path, ref = kimi
    other = build_kimi(tmp_path / "other", seed=7)
    hf = kimi_reference(other)
    with kda_core_float64():
        ref_b = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    for kw in (dict(num_kv_pages=14, max_num_batched_tokens=8), dict(num_state_snapshots=1),
               dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)):
        eng = build(path, True, **kw)
        try:
            aborted = []

            def abort(e, aborted=aborted):
                if e.steps == 3 and not aborted:
                    aborted.append(e.abort("2"))

            done, _, _ = serve(eng, [[(str(i), p) for i, p in enumerate(PROMPTS)]], on_step=abort)
            assert aborted and aborted[0] is not None and aborted[0].outputs[0].finish_reason == "abort"
            assert all(done[str(i)][0] == ref[i] for i in (0, 1, 3, 4, 5)), kw
            st = eng.stats()
            if "num_kv_pages" in kw:
                assert st["num_preemptions"] > 0
            if "num_state_snapshots" in kw:
                assert st["prefix_snapshots_evicted"] > 0 and st["prefix_snapshots_used"] <= 1
            eng.update_weights_from_tensors(load_file(f"{other}/model.safetensors"))
            st = eng.stats()
            assert st["prefix_snapshots_used"] == 0 and st["prefix_cache_blocks"] == 0
            hits = st["prefix_snapshot_hits"]
            done, _, _ = serve(eng, [[(f"b{i}", p)] for i, p in enumerate(PROMPTS)])
            assert [done[f"b{i}"][0] for i in range(len(PROMPTS))] == ref_b, kw
            # the new weights' own snapshots (one row: A's, at 20, is evicted before A comes again)
            assert eng.stats()["prefix_snapshot_hits"] - hits == (2 if "num_state_snapshots" in kw else 3)
            assert eng.stats()["state_slots_used"] == 0
        finally:
            eng.shutdown()


def test_the_books_count_snapshot_rows_and_catch_their_corruption():
    """Rows after the live slots, each free or the state of the one indexed block naming it: a leaked
    row, a row two blocks name and a snapshot left on a stale block are each caught; an eviction of
    the block, the pool's LRU and an invalidation return rows exactly once."""
    from splash.kv.allocator import KVAllocator
    from splash.kv.books import Holder, book_errors
    from splash.kv.slots import SlotAllocator
    from splash.kv.snapshots import SnapshotPool

    def fresh():
        alloc = KVAllocator(8, 4)
        cache = alloc.enable_prefix_cache()
        alloc.slots, cache.snaps = SlotAllocator(2), SnapshotPool(2, 2)
        table = alloc.empty_table()
        alloc.grow(table, 12, 0)
        keys = cache.keys(list(range(12)), 3)
        blocks = [cache.register(k, j, [table[0][j]]) for j, k in enumerate(keys)]
        for b in blocks:
            b.ready = True
        return alloc, cache, table, blocks

    alloc, cache, table, blocks = fresh()
    held = {1: Holder(table, 0, -1, blocks)}
    assert cache.snaps.save(0, blocks[0]) and cache.snaps.save(0, blocks[1])
    assert book_errors(alloc, held) == []
    assert cache.snaps.save(0, blocks[2]) and blocks[0].snap < 0 and cache.snaps.evicted == 1  # LRU
    assert cache.snaps.pending == [(0, 2), (0, 3), (0, 2)] and book_errors(alloc, held) == []
    blocks[1].snap = -1  # a row the books lose
    assert any("leaked" in e or "disagree" in e for e in book_errors(alloc, held))
    alloc, cache, table, blocks = fresh()
    held = {1: Holder(table, 0, -1, blocks)}
    cache.snaps.save(0, blocks[0])
    blocks[1].snap = blocks[0].snap  # two blocks name one row
    assert any("two blocks" in e for e in book_errors(alloc, held))
    blocks[1].snap = -1
    alloc.invalidate_cache()  # held blocks turn stale: their snapshots go, counted
    assert cache.snaps.num_used == 0 and cache.snaps.dropped == 1 and book_errors(alloc, held) == []
    alloc.release(table)
    assert book_errors(alloc, {}) == [] and cache.snaps.errors([]) == []
