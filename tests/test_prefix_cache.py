"""The prefix cache (splash/kv/prefix.py): shared full pages give the same answer as no cache.

Float64 tiny checkpoints (a DeepSeek-V3 and a DSA one, whose indexer keys are shared with the latent),
prompts sharing prefixes (a GRPO-shaped group sent as n samples and as separate requests, a conversation
whose turns resend the history), chunked prefill of 8 rows. Checked: tokens equal transformers' and
logits equal the uncached single-rank engine's (1e-9) at T = 1, in every layout at T = 2 (and T = 4 for
one), through eviction pressure, preemption and abort; the cache is really hit; every page is either in a
live table or cached, never leaked, and the pool is empty once idle and flushed; a weight update
invalidates the cache (no stale page is read); live switches in every direction (a fixed schedule and a
seeded random one) drop unreferenced cached pages and move shared ones once, with their holders.
"""

from __future__ import annotations

import pytest
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference
from helpers_dsa import build_dsa_checkpoint, hf_dsa_reference
from test_engine_switch import accounting_errors

from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams
from splash.kv.allocator import KVAllocator
from splash.kv.prefix import PrefixCache

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

NEW = 5
P = 4
BASE = list(range(10, 40))  # a 30-token shared prefix: 7 full pages
PROMPTS = [BASE + [5, 6], BASE + [7, 8, 9], list(range(3, 12)), BASE, BASE + [5, 6]]
ENGINE = dict(dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=8, device="cpu")


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=n)


def run(eng, prompts, n: int = 1, rounds: int = 1, abort: str | None = None):
    """Greedy tokens per (round, prompt) (each sample's when n > 1), logits per sampled row, errors."""
    logits: dict = {}
    errors: list[str] = []

    def hook(plan, seqs, rows):
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
            logits[(seq.group.request_id, seq.index, len(seq.output_token_ids))] = row.clone()

    eng.logits_hook = hook
    done = {}
    for rnd in range(rounds):
        for i, p in enumerate(prompts):
            eng.add_request(f"{rnd}-{i}", prompt_token_ids=p, params=greedy(n))
        while eng.has_unfinished():
            if abort is not None and eng.steps == 3 and abort in eng.requests:
                done[abort] = eng.abort(abort)
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            errors += [f"step {eng.steps}: {e}" for e in accounting_errors(eng)]
    eng.logits_hook = None
    return done, logits, errors


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("pc") / "v3", "v3", seed=3)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    eng = build_engine(model=path, num_kv_pages=64, **ENGINE)
    try:
        _, logits, _ = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    return path, ref, logits


def close(logits, ref_logits, name: str) -> None:
    """Every sampled row of the cached run equals the uncached single-rank run's (round 0 and later
    rounds: keyed by prompt index and position)."""
    want = {(k[0].split("-")[1], k[2]): v for k, v in ref_logits.items()}
    for k, v in logits.items():
        ref = want[(k[0].split("-")[1], k[2])]
        err = (v - ref).abs().max().item()
        assert err < 1e-9, f"{name}: {k} differs by {err:.2e}"


def test_prefix_cache_unit():
    """Blocks by content, references, LRU eviction of unreferenced pages (counted free), invalidation."""
    alloc = KVAllocator(8, P, world=1)
    cache = alloc.enable_prefix_cache()
    toks = list(range(13))
    keys = cache.keys(toks, PrefixCache.reusable_pages(len(toks), P))
    assert len(keys) == 3 and keys == cache.keys(toks + [99], 3)  # a chain: the same prefix, same keys
    assert cache.keys([99] + toks[1:], 3)[0] != keys[0]
    table = alloc.empty_table()
    alloc.grow(table, 13, 0)
    blocks = [cache.register(k, j, [table[0][j]]) for j, k in enumerate(keys)]
    assert cache.match(keys) == ([], True)  # registered, not computed yet: wait for it
    for b in blocks:
        b.ready = True
    got, wait = cache.match(keys)
    assert got == blocks and not wait
    cache.take(got[:2])  # a second table shares two pages
    other = [[b.column[0] for b in got[:2]]]
    alloc.grow(other, 9, 0)
    assert alloc.num_used == [5] and cache.shared_blocks() == 2
    alloc.release(table)  # the first table goes: its private page is freed, blocks stay referenced
    assert alloc.num_used == [3] and [b.refs for b in blocks] == [1, 1, 0]
    alloc.release(other)
    assert alloc.num_used == [0] and cache.evictable() == [3] and alloc.num_free == [8]
    big = alloc.empty_table()
    alloc.grow(big, 8 * P, 0)  # the whole pool: every cached page is evicted for it
    assert cache.blocks == {} and alloc.num_used == [8]
    alloc.release(big)
    assert alloc.ranks[0].num_free == 8


def test_one_rank_matches_and_hits(v3):
    path, ref, ref_logits = v3
    eng = build_engine(model=path, num_kv_pages=64, enable_prefix_caching=True, **ENGINE)
    try:
        done, logits, errors = run(eng, PROMPTS, rounds=2)
        st = eng.stats()
        assert st["prefix_cache_hits"] > 0.5 * st["prefix_cache_queries"]
        assert done["1-0"].num_cached_tokens == 28 and done["0-4"].num_cached_tokens == 28
        eng.flush_cache()
        assert eng.allocator.ranks[0].num_free == eng.allocator.ranks[0].num_pages
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert [done[f"{r}-{i}"].outputs[0].token_ids for r in range(2) for i in range(5)] == ref * 2
    close(logits, ref_logits, "T=1")


def test_n_samples_share_one_prefill_and_pressure(v3):
    """n = 4 samples of each prompt: one prefill of the shared pages (the others wait, then hit); a pool
    too small for the batch preempts and evicts; an abort mid-run; nothing leaks."""
    path, ref, _ = v3
    eng = build_engine(model=path, num_kv_pages=64, enable_prefix_caching=True, **ENGINE)
    try:
        done, _, errors = run(eng, PROMPTS[:2], n=4)
        hits = eng.stats()["prefix_cache_hits"]
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert all(c.token_ids == ref[i] for i in range(2) for c in done[f"0-{i}"].outputs)
    assert hits >= 7 * 28  # 3 siblings of each + the second prompt's 7 pages hit
    eng = build_engine(model=path, num_kv_pages=12, enable_prefix_caching=True, **ENGINE)
    try:
        done, _, errors = run(eng, PROMPTS, n=2, rounds=2, abort="0-2")
        assert eng.scheduler.num_preemptions > 0
        eng.flush_cache()
        assert eng.allocator.ranks[0].num_free == 12
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert done["0-2"].outputs[0].finish_reason == "abort"
    for key, o in done.items():
        if key != "0-2":
            assert all(c.token_ids == ref[int(key.split("-")[1])] for c in o.outputs), key


def test_weight_update_invalidates(v3, tmp_path):
    from safetensors.torch import load_file

    path, ref, _ = v3
    other = build_checkpoint(tmp_path / "b", "v3", seed=9)
    hf = hf_reference(other)
    ref_b = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    eng = build_engine(model=path, num_kv_pages=64, enable_prefix_caching=True, **ENGINE)
    try:
        run(eng, PROMPTS)
        assert eng.allocator.cache.blocks
        eng.update_weights_from_tensors(load_file(f"{other}/model.safetensors"))
        assert not eng.allocator.cache.blocks
        done, _, errors = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert [done[f"0-{i}"].outputs[0].token_ids for i in range(5)] == ref_b


def test_weight_update_with_requests_in_flight(group, v3, tmp_path):
    """The RL loop's move (issue: a soak double-freed pages): a GRPO group of 4 samples sharing prefix
    pages, and other prompts, are mid-decode when the weights change. They keep their pages and finish
    (their earlier rows were computed with the old weights, as SGLang's partial rollouts); the cache
    forgets every page at once, so requests after the update answer exactly as the new weights do
    (transformers'); shared pages are freed once, by their last holder; the books balance after every
    step (the suite's debug check), at T = 1 and at T = 2 with live switches landing on the steps right
    after each update; once idle and flushed, the pool is empty."""
    from safetensors.torch import load_file

    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, ref, _ = v3
    other = build_checkpoint(tmp_path / "b", "v3", seed=9)
    hf = hf_reference(other)
    ref_b = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    weights = {"a": load_file(f"{path}/model.safetensors"), "b": load_file(f"{other}/model.safetensors")}
    for world in (1, 2):
        kw = {} if world == 1 else dict(rank_group=group, layout="dp")
        eng = build_engine(model=path, num_kv_pages=64, enable_prefix_caching=True, **kw, **ENGINE)
        try:
            long = SamplingParams(temperature=0.0, max_tokens=3 * NEW, ignore_eos=True, n=4)
            eng.add_request("group", prompt_token_ids=PROMPTS[0], params=long)
            eng.add_request("solo", prompt_token_ids=PROMPTS[2], params=greedy())
            outs, errors, updates = {}, [], 0
            switches = iter(["tp", "cp", "dop"])

            def update(name: str, eng=eng, world=world, switches=switches) -> None:
                eng.update_weights_from_tensors(weights[name])
                if world == 2:  # a live switch lands on the very next step
                    eng.switcher.request(next(switches))

            while "group" not in outs:
                if updates == 0 and eng.allocator.cache.shared_blocks() > 0:  # mid-flight, sharing
                    update("b")
                    updates, since = 1, 0
                elif updates == 1 and since == 4:  # two more in a row, still mid-flight
                    update("a")
                    update("b")
                    updates = 2
                outs.update({o.request_id: o for o in eng.step() if o.finished})
                errors += accounting_errors(eng)
                since = since + 1 if updates else 0
            assert updates == 2, "the group finished before the updates"
            for i, p in enumerate(PROMPTS):
                eng.add_request(f"after-{i}", prompt_token_ids=p, params=greedy())
            while eng.has_unfinished():
                outs.update({o.request_id: o for o in eng.step() if o.finished})
                errors += accounting_errors(eng)
            assert not errors, (world, errors[:3])
            assert all(c.finish_reason == "length" and len(c.token_ids) == 3 * NEW
                       for c in outs["group"].outputs)
            for i in range(len(PROMPTS)):
                assert outs[f"after-{i}"].outputs[0].token_ids == ref_b[i], (world, i)
            if world == 2:
                assert sum(e.refused is None for e in eng.switcher.events) >= 2
            eng.flush_cache()
            assert [a.num_free for a in eng.allocator.ranks] == [a.num_pages for a in eng.allocator.ranks]
        finally:
            eng.shutdown()


def test_every_layout(group, v3):
    path, ref, ref_logits = v3
    layouts = ("tp", "dp", "cp", "dop") if group.world == 2 else ("dp", "cp")
    for layout in layouts:
        eng = build_engine(model=path, layout=layout, rank_group=group, num_kv_pages=64,
                           enable_prefix_caching=True, **ENGINE)
        try:
            done, logits, errors = run(eng, PROMPTS, rounds=2)
            hits = eng.stats()["prefix_cache_hits"]
        finally:
            eng.shutdown()
        name = f"T={group.world} {layout}"
        assert not errors, f"{name}: {errors[:5]}"
        assert [done[f"{r}-{i}"].outputs[0].token_ids for r in range(2) for i in range(5)] == ref * 2, name
        close(logits, ref_logits, name)
        assert hits > 0, name


SCHEDULES = {
    "every-direction": "2:dp,4:cp,6:dop,8:tp,10:cp,12:dp,14:tp,16:dop,18:cp,20:tp,22:dp,24:dop,26:dp",
    "random": None,  # seeded below
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_switches_move_shared_pages_once(group, v3, schedule):
    """Live switches while n = 2 samples of each prompt share their prefix pages: every switch goes
    through (shared pages move once, with their holders; references and the cache index survive), the
    answers equal transformers' and the uncached run's, and every page is accounted for at every step."""
    import random

    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, ref, ref_logits = v3
    sched = SCHEDULES[schedule]
    if sched is None:
        rng = random.Random(7)
        cur, parts = "tp", []
        for step in sorted(rng.sample(range(1, 40), 12)):
            cur = rng.choice([x for x in ("tp", "dp", "cp", "dop") if x != cur])
            parts.append(f"{step}:{cur}")
        sched = ",".join(parts)
    eng = build_engine(model=path, layout="tp", rank_group=group, num_kv_pages=64, enable_prefix_caching=True,
                       switch_schedule=sched, **ENGINE)
    shared_at_switch = []
    try:
        cache = eng.allocator.cache
        orig = eng.switcher._switch_to

        def spy(st, dst, cause, mode, live):
            if dst is not None and dst != eng.allocator.layout:
                shared_at_switch.append(cache.shared_blocks())
            return orig(st, dst, cause, mode, live)

        eng.switcher._switch_to = spy
        done, logits, errors = run(eng, PROMPTS, n=2, rounds=2)
        events = list(eng.switcher.events)
        hits = eng.stats()["prefix_cache_hits"]
        eng.flush_cache()
        assert [a.num_free for a in eng.allocator.ranks] == [a.num_pages for a in eng.allocator.ranks]
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    for r in range(2):
        for i in range(5):
            assert all(c.token_ids == ref[i] for c in done[f"{r}-{i}"].outputs), (r, i)
    close(logits, ref_logits, f"switches {schedule}")
    assert events and all(e.refused is None for e in events), [e.message for e in events if e.refused]
    assert max(shared_at_switch) > 0 and hits > 0  # some switches really moved shared pages


def test_planner_counts_shared_pages_once():
    """Two tables sharing 3 pages: a switch allocates, moves and frees each shared page once, its
    sharers take the same destination pages, the manifest's bytes are the unique pages', and the
    cache's blocks follow their pages."""
    from splash.core.presets import PRESETS
    from splash.switch import LiveRequest, SwitchPlanner

    cfg = PRESETS["tiny"]
    for src, dst in (("dp", "tp"), ("tp", "dp"), ("tp", "cp"), ("cp", "dop"), ("dop", "cp")):
        alloc = KVAllocator(32, P, world=2, layout=src)
        cache = alloc.enable_prefix_cache()
        a, b = alloc.empty_table(), alloc.empty_table()
        alloc.grow(a, 14, 1)  # 4 pages; the first 3 become blocks b shares
        keys = cache.keys(list(range(14)), 3)
        blocks = [cache.register(k, j, [row[j] for row in a]) for j, k in enumerate(keys)]
        for blk in blocks:
            blk.ready = True
        cache.take(blocks)
        for r in range(2):
            b[r].extend(blk.column[r] for blk in blocks)
        alloc.grow(b, 18, 1)  # 2 pages of its own
        live = [LiveRequest(1, 14, 1, [row[:] for row in a]), LiveRequest(2, 18, 1, [row[:] for row in b])]
        used = list(alloc.num_used)
        planner = SwitchPlanner(cfg, alloc, "float64")
        plan = planner.plan(dst, live)
        assert not isinstance(plan, type(None)) and hasattr(plan, "tables"), plan
        ta, tb = plan.tables[1], plan.tables[2]
        assert [row[:3] for row in ta] == [row[:3] for row in tb], (src, dst)
        unique_pages = 4 + 2  # a's 4 + b's own 2
        held_after = [sum(p >= 0 for p in set(ta[r] + tb[r])) for r in range(2)]
        assert [u + n - len(f) for u, n, f in zip(used, plan.headroom.new_pages, plan.frees)] == held_after
        moved = sum(plan.kv_send_tokens(r)[q] for r in range(2) for q in range(2))
        man_tokens = sum(plan.layers[0].kv_recv_bytes) / planner.sizes.kv_token_bytes(0)
        assert moved == round(man_tokens)
        # the moved tokens: each unique page's, once per rank that newly holds it
        unique = [(a, ta, j, min(P, 14 - j * P)) for j in range(4)] + [(b, tb, j, min(P, 18 - j * P))
                                                                       for j in (3, 4)]
        want = sum(tok * sum(1 for r in range(2) if dt[r][j] >= 0 and st[r][j] < 0)
                   for st, dt, j, tok in unique)
        assert moved == want, (src, dst, moved, want)
        assert sum(map(len, plan.frees)) + sum(plan.headroom.new_pages) <= 2 * unique_pages
        planner.commit(plan)
        alloc.cache_moved({1: a, 2: b}, plan.tables)
        want_cols = [tuple(row[j] for row in ta) for j in range(3)]
        assert [blk.column for blk in cache.blocks.values()] == want_cols
        assert [blk.refs for blk in cache.blocks.values()] == [2, 2, 2]
        alloc.release(plan.tables[1])
        alloc.release(plan.tables[2])
        alloc.evict_all()
        assert [x.num_free for x in alloc.ranks] == [32, 32], (src, dst)


def test_dsa_model_shares_indexer_keys(tmp_path):
    """A DSA model's pages hold the latent and the indexer's keys: a cached prefix serves both."""
    path = build_dsa_checkpoint(tmp_path / "dsa", "v32", seed=3, index_head_dim=48)
    hf = hf_dsa_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    eng = build_engine(model=path, num_kv_pages=64, enable_prefix_caching=True, **ENGINE)
    try:
        done, _, errors = run(eng, PROMPTS, rounds=2)
        assert eng.stats()["prefix_cache_hits"] > 0
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert [done[f"{r}-{i}"].outputs[0].token_ids for r in range(2) for i in range(5)] == ref * 2


def test_server_reports_cached_tokens():
    """`splash serve --enable-prefix-caching`: a repeated prompt's usage says how much came from the cache
    (OpenAI's prompt_tokens_details.cached_tokens, the native meta_info.cached_tokens), /metrics counts
    queries and hits, /flush_cache empties it."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from serve_utils import ServeProcess

    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--num-kv-pages", "32",
                        "--max-num-seqs", "4", "--enable-prefix-caching"])
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        prompt = list(range(40, 90))
        first = c.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
        again = c.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # 3 full pages of 16 of the 50 tokens; the page with the last token stays the request's own
        assert again.usage.prompt_tokens_details.cached_tokens == 48
        assert again.choices[0].text == first.choices[0].text
        r = httpx.post(srv.url + "/generate", json={"input_ids": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 2}}, timeout=60).json()
        assert r["meta_info"]["cached_tokens"] == 48
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert got["splash:prefix_cache_hits_total"] == 96 and got["splash:prefix_cache_queries_total"] == 150
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
        again = c.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        srv.close()


def test_multiturn_conversation_hits_its_history(group, v3):
    """A conversation of 4 turns, each resending the whole history (prompt + the answer so far + new
    tokens), at T = 1 and at T = 2 under live switches: every turn's answer equals transformers', and
    from turn 2 on the history's full pages, the generated ones included, come from the cache."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, _, _ = v3
    hf = hf_reference(path)
    for world in (1, 2):
        sched = "3:cp,8:dp,14:tp,20:dop"
        kw = {} if world == 1 else dict(rank_group=group, layout="dop", switch_schedule=sched)
        eng = build_engine(model=path, num_kv_pages=64, **kw, **ENGINE)
        try:
            history, computed = list(range(20, 33)), 0
            for turn in range(4):
                eng.add_request(f"t{turn}", prompt_token_ids=history, params=greedy())
                out, errors = None, []
                while eng.has_unfinished():
                    for o in eng.step():
                        if o.finished:
                            out = o
                    errors += accounting_errors(eng)
                assert not errors, (world, turn, errors[:3])
                assert out.outputs[0].token_ids == hf_greedy(hf, history, NEW), (world, turn)
                # the pages the last turn computed (its last sampled token never was), up to this
                # prompt's reusable pages
                want = 0 if turn == 0 else min((len(history) - 1) // P, computed // P) * P
                assert out.num_cached_tokens == want, (world, turn)
                computed = len(history) + NEW - 1
                history = history + out.outputs[0].token_ids + [40 + turn, 41 + turn, 42 + turn]
            if world == 2:
                assert any(e.refused is None for e in eng.switcher.events)
        finally:
            eng.shutdown()


def test_auto_prices_a_cached_prefix_as_free_prefill(group, v3, monkeypatch):
    """`--layout auto` prices each step from the rows it computes: a request whose prefix came from the
    cache brings only its uncached tokens as query rows (the Policy's q_i), so over a run the rows it
    priced are the prompt tokens minus the cache hits, plus one per decode step."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, ref, _ = v3
    from splash.switch.auto import AutoLayout

    priced: list[tuple[int, int]] = []
    orig = AutoLayout._batch

    def spy(self, plan, live):
        b = orig(self, plan, live)
        priced.append((int(b.rows.sum()), sum(s.num_new for s in plan.seqs)))
        return b

    monkeypatch.setattr(AutoLayout, "_batch", spy)
    eng = build_engine(model=path, layout="auto", rank_group=group, num_kv_pages=64, **ENGINE)
    try:
        done, _, errors = run(eng, PROMPTS, n=2, rounds=2)
        hits = eng.stats()["prefix_cache_hits"]
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert all(c.token_ids == ref[int(k.split("-")[1])] for k, o in done.items() for c in o.outputs)
    assert priced and all(q == rows for q, rows in priced)  # exactly the rows the step computes
    cached = sum(o.num_cached_tokens for o in done.values())
    assert hits > 0 and cached > 0
