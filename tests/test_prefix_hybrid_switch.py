"""The prefix cache of KDA hybrids on T = 2 gloo ranks (splash/kv/snapshots.py): every layout, and live
switches through all 12 directions and a random schedule.

A snapshot is a row of every rank's StatePool after the live slots, so it is placed as live state is
(head-sharded in TP/DOP, on the owner in DP, replicated in CP) and a save or load is the same row copy
on every rank. A live switch moves the snapshots of the blocks live tables hold with the live slots
(the unreferenced blocks were flushed before it), and a request admitted after it starts from one.
Checked, float64: greedy tokens equal transformers' and every sampled row's logits equal the
single-rank cache-off engine's to 1e-9, with hits, cut-back misses and misses, all at once and in a
second wave; the books after every step.
"""

from __future__ import annotations

import pytest
from helpers_ckpt import hf_greedy
from helpers_kda import build_kimi, kda_core_float64, kimi_reference
from test_engine_switch import ALL12, CIRCUIT, close

from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

NEW = 5
A = list(range(10, 31))
PROMPTS = [A, A + [3, 4, 5, 6, 7], A[:13] + [50, 51, 52], A[:13] + [60, 61, 62, 63, 64], [5, 6, 7],
           [17, 18, 2, 44, 71, 9, 9, 13, 60, 12, 50]]
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=8, device="cpu")
PAGES_TIGHT = 8  # (32 tokens: the longest request, 26 + 5, just fits)


@pytest.fixture(scope="module")
def group():
    from splash.engine.group import RankGroup

    g = RankGroup.start(2, device="cpu", timeout_s=60.0, threads=1)
    yield g
    g.close()


def serve(eng):
    """All prompts at once, then all again: tokens {(wave, i): ...}, logits {(wave, i, pos): row}, books."""
    logits, errors, done = {}, [], {}

    def hook(plan, seqs, rows):
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
            logits[(seq.group.request_id, len(seq.output_token_ids))] = row.clone()

    eng.logits_hook = hook
    try:
        for wave in ("a", "b"):
            for i, p in enumerate(PROMPTS):
                eng.add_request(f"{wave}{i}", prompt_token_ids=p, params=SamplingParams(
                    temperature=0.0, max_tokens=NEW, ignore_eos=True))
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
                errors += [f"step {eng.steps}: {e}" for e in eng.scheduler.book_errors()]
        st = eng.stats()
        events = list(eng.switcher.events) if eng.switcher is not None else []
    finally:
        eng.logits_hook = None
        eng.shutdown()
    assert st["state_slots_used"] == 0, "a state slot outlived its request"
    return done, logits, errors, st, events


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint, transformers' greedy tokens, the single-rank cache-off engine's logits."""
    path = build_kimi(tmp_path_factory.mktemp("pswitch") / "k", seed=5)
    hf = kimi_reference(path)
    with kda_core_float64():
        ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    done, logits, errors, _, _ = serve(build_engine(model=path, num_kv_pages=96, enable_prefix_caching=False,
                                                    **ENGINE))
    assert not errors
    assert [done[f"{w}{i}"] for w in "ab" for i in range(len(PROMPTS))] == ref * 2
    return path, ref, logits


def check(ckpt, name, got):
    _, ref, ref_logits = ckpt
    done, logits, errors, st, events = got
    assert not errors, f"{name}: {errors[:5]}"
    assert [done[f"{w}{i}"] for w in "ab" for i in range(len(PROMPTS))] == ref * 2, f"{name}: tokens"
    close(logits, ref_logits, name)
    return st, events


@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_every_layout(group, ckpt, layout):
    st, _ = check(ckpt, f"T=2 {layout}", serve(build_engine(
        model=ckpt[0], layout=layout, rank_group=group, num_kv_pages=96, enable_prefix_caching=True,
        **ENGINE)))
    assert st["prefix_snapshot_hits"] >= 4, st  # wave b's A, A + 5, and the partial hits at least
    assert st["prefix_snapshots_dropped"] == 0


def test_all_12_directions_move_snapshots_and_stay_exact(group, ckpt):
    st, events = check(ckpt, "T=2 all 12", serve(build_engine(
        model=ckpt[0], layout="tp", rank_group=group, num_kv_pages=96, enable_prefix_caching=True,
        switch_schedule=ALL12, **ENGINE)))
    assert {(e.src, e.dst) for e in events if e.refused is None} == set(zip(CIRCUIT, CIRCUIT[1:]))
    assert st["prefix_snapshots_saved"] > 0 and st["prefix_snapshots_dropped"] == 0, st
    assert st["prefix_snapshots_moved"] > 0, st  # (switches found some and carried them)
    # (fewer hits than without switches: each switch first flushes the blocks no table holds)
    assert st["prefix_snapshot_hits"] >= 1, st


def test_a_snapshot_moved_by_each_direction_is_read_after_it(group, ckpt):
    """Each of the 12 directions, alone: prompt A is computed (its snapshot taken) in the source layout,
    the switch happens while a request holds A's blocks, and A + 5 then starts from the moved snapshot
    in the destination layout; its tokens and logits are the cache-off engine's."""
    _, ref, ref_logits = ckpt
    for src, dst in zip(CIRCUIT, CIRCUIT[1:]):
        eng = build_engine(model=ckpt[0], layout=src, rank_group=group, num_kv_pages=96,
                           enable_prefix_caching=True, **ENGINE)
        logits, done = {}, {}

        def hook(plan, seqs, rows, logits=logits):
            for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
                logits[(seq.group.request_id, len(seq.output_token_ids))] = row.clone()

        eng.logits_hook = hook
        try:
            params = SamplingParams(temperature=0.0, max_tokens=NEW + 40, ignore_eos=True)
            eng.add_request("a0", prompt_token_ids=PROMPTS[0], params=params)  # (holds A while switching)
            while eng.stats()["prefix_snapshots_used"] == 0 or not eng.scheduler.running:
                eng.step()
            eng.switcher.request(dst)
            eng.step()
            assert eng.switcher.alloc.layout == dst, f"{src}->{dst}: the switch did not happen"
            moved = eng.stats()["prefix_snapshots_moved"]
            eng.add_request("b1", prompt_token_ids=PROMPTS[1], params=SamplingParams(
                temperature=0.0, max_tokens=NEW, ignore_eos=True))
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
                assert not eng.scheduler.book_errors()
            st = eng.stats()
        finally:
            eng.logits_hook = None
            eng.shutdown()
        name = f"{src}->{dst}"
        assert moved >= 1 and st["prefix_snapshot_hits"] == 1, (name, st)
        assert done["b1"] == ref[1], name
        close({("b1", k[1]): v for k, v in logits.items() if k[0] == "b1"},
              {("b1", k[1]): v for k, v in ref_logits.items() if k[0] == "a1"}, name)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_switch_schedules(group, ckpt, seed):
    import random

    rng = random.Random(300 + seed)
    layouts = ["tp", "dp", "cp", "dop"]
    cur = start = rng.choice(layouts)
    steps = []
    for step in sorted(rng.sample(range(1, 24), 8)):
        cur = rng.choice([x for x in layouts if x != cur])
        steps.append(f"{step}:{cur}")
    name = f"seed {seed}: {start} {','.join(steps)}"
    st, _ = check(ckpt, name, serve(build_engine(
        model=ckpt[0], layout=start, rank_group=group, num_kv_pages=96, enable_prefix_caching=True,
        switch_schedule=",".join(steps), **ENGINE)))
    assert st["num_switches"] == 8, name


def test_tight_pool_abort_and_update_under_switches(group, ckpt, tmp_path):
    """A pool too small for everyone at once, an abort mid-run, switches throughout (many refused while
    the pool is full), then a weight update: no snapshot survives it and the tokens are the new
    checkpoint's. (Preemption with the cache on: tests/test_prefix_hybrid.py, at T = 1.)"""
    from safetensors.torch import load_file

    path, ref, _ = ckpt
    other = build_kimi(tmp_path / "other", seed=9)
    hf = kimi_reference(other)
    with kda_core_float64():
        ref_b = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    sched = ",".join(f"{s}:{lay}" for s, lay in zip(range(3, 80, 2), ["cp", "dp", "tp", "dop"] * 10))
    eng = build_engine(model=path, layout="dop", rank_group=group, num_kv_pages=PAGES_TIGHT,
                       switch_schedule=sched, enable_prefix_caching=True, **ENGINE)
    try:
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), prompt_token_ids=p, params=SamplingParams(
                temperature=0.0, max_tokens=NEW, ignore_eos=True))
        done, errors = {}, []
        while eng.has_unfinished():
            if eng.steps == 4:
                done["2"] = eng.abort("2").outputs[0].token_ids
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            errors += eng.scheduler.book_errors()
        st = eng.stats()
        assert not errors, errors[:5]
        assert st["num_switches"] >= 1, st
        assert all(done[str(i)] == ref[i] for i in (0, 1, 3, 4, 5)), (done, ref)
        eng.update_weights_from_tensors(load_file(f"{other}/model.safetensors"))
        assert eng.stats()["prefix_snapshots_used"] == 0
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"b{i}", prompt_token_ids=p, params=SamplingParams(
                temperature=0.0, max_tokens=NEW, ignore_eos=True))
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            errors += eng.scheduler.book_errors()
        assert not errors, errors[:5]
        assert [done[f"b{i}"] for i in range(len(PROMPTS))] == ref_b
        assert eng.stats()["state_slots_used"] == 0 and sum(eng.stats()["kv_pages_used_per_rank"]) == 0
    finally:
        eng.shutdown()
