"""LLMEngine / AsyncEngine logic on a model-free runner: stops, n, seeds, abort, refusals, streaming,
failures; pages always come back."""

import asyncio

import pytest
from engine_fakes import EOS, VOCAB, ByteTok, FakeRunner, fake_spec, next_token

from splash.engine.async_engine import AsyncEngine, EngineError
from splash.engine.llm_engine import LLMEngine
from splash.engine.outputs import RequestOutput
from splash.engine.sampling import SamplingParams
from splash.kv.allocator import KVAllocator


def make_engine(pages=256, page_size=4, max_num_seqs=8, budget=16, max_model_len=512, rule=next_token,
                fail_at_step=None):
    alloc = KVAllocator(pages, page_size)
    spec = fake_spec(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                     page_size=page_size, eos_token_ids=(EOS,))
    return LLMEngine(spec, FakeRunner(rule, fail_at_step), alloc, tokenizer=ByteTok())


def run_all(eng):
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def ref(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def greedy(**kw):
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_greedy_matches_reference_with_chunking_batching_and_preemption():
    eng = make_engine(pages=14, page_size=4, max_num_seqs=6, budget=8)  # 56 tokens: forces preemption
    prompts = [[11 + i] * (3 + 5 * i) for i in range(5)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, params=greedy(max_tokens=12))
    final = run_all(eng)
    for i, p in enumerate(prompts):
        assert final[f"r{i}"].outputs[0].token_ids == ref(p, 12)
        assert final[f"r{i}"].outputs[0].finish_reason == "length"
    assert eng.scheduler.num_preemptions > 0
    st = eng.stats()
    assert st["prompt_tokens_total"] == sum(map(len, prompts)) and st["generation_tokens_total"] == 5 * 12
    assert eng.allocator.num_used == [0] and st["num_running"] == 0


def test_stop_string_truncates_text_and_keeps_token():
    word = [ord(c) + 10 for c in "abcXYZdef"]
    eng = make_engine(rule=lambda h: word[(len(h) - 2) % len(word)])
    eng.add_request("s", prompt_token_ids=[20, 21], params=greedy(max_tokens=30, stop=["XY"]))
    out = run_all(eng)["s"].outputs[0]
    assert out.text == "abc" and out.finish_reason == "stop" and out.stop_reason == "XY"
    assert out.token_ids == word[:5]  # the token that completed the stop string is kept


def test_eos_stop_token_ids_min_tokens_and_ignore_eos():
    seq = [30, 31, EOS, 32, 33, 34, 35]
    rule = lambda h: seq[min(len(h) - 1, len(seq) - 1)]  # noqa: E731
    eng = make_engine(rule=rule)
    eng.add_request("eos", prompt_token_ids=[5], params=SamplingParams(temperature=0.0, max_tokens=20))
    eng.add_request("ign", prompt_token_ids=[5], params=greedy(max_tokens=5))
    eng.add_request("ids", prompt_token_ids=[5], params=greedy(max_tokens=20, stop_token_ids=[33]))
    final = run_all(eng)
    assert final["eos"].outputs[0].token_ids == [30, 31, EOS]
    assert final["eos"].outputs[0].finish_reason == "stop" and final["eos"].outputs[0].stop_reason is None
    assert final["ign"].outputs[0].token_ids == [30, 31, EOS, 32, 33]
    assert final["ign"].outputs[0].finish_reason == "length"
    ids = final["ids"].outputs[0]
    assert ids.token_ids == [30, 31, EOS, 32, 33] and ids.stop_reason == 33
    assert ids.text == "".join(chr(t - 10) for t in [30, 31, 32])
    # min_tokens masks EOS in the logits, so the next best token is sampled instead.
    eng = make_engine(rule=rule)
    eng.add_request("min", prompt_token_ids=[5], params=SamplingParams(temperature=0.0, max_tokens=6,
                                                                       min_tokens=4))
    out = run_all(eng)["min"].outputs[0]
    assert EOS not in out.token_ids[:4] and len(out.token_ids) >= 4
    assert eng.allocator.num_used == [0]


def test_n_sequences_seeded_sampling_and_logprobs():
    def sample(seed):
        eng = make_engine()
        p = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True, logprobs=2)
        eng.add_request("x", prompt_token_ids=[12, 13], params=p)
        out = run_all(eng)["x"]
        assert eng.allocator.num_used == [0]
        return out
    a, b, c = sample(7), sample(7), sample(8)
    ta = [o.token_ids for o in a.outputs]
    assert [o.index for o in a.outputs] == [0, 1, 2] and all(len(t) == 8 for t in ta)
    assert ta == [o.token_ids for o in b.outputs] and ta != [o.token_ids for o in c.outputs]
    assert len(set(map(tuple, ta))) > 1  # children draw independently
    lp = a.outputs[0].logprobs
    assert len(lp) == 8 and all(tok in d and len(d) in (2, 3) for tok, d in zip(ta[0], lp))


def test_abort_frees_pages_and_refusals_are_clear():
    eng = make_engine(pages=8, page_size=4, max_model_len=64)
    eng.add_request("a", prompt_token_ids=[11] * 10, params=greedy(max_tokens=20))
    eng.step()
    assert eng.allocator.num_used[0] > 0
    out = eng.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.allocator.num_used == [0] and not eng.has_unfinished()
    assert eng.abort("a") is None
    with pytest.raises(ValueError, match="context"):
        eng.add_request("b", prompt_token_ids=[11] * 64)
    with pytest.raises(ValueError, match="KV pool"):
        eng.add_request("b", prompt_token_ids=[11] * 40)  # pool is 32 tokens
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("b", prompt_token_ids=[VOCAB + 5])
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("b", prompt_token_ids=[])
    eng.add_request("b", prompt="hi", params=greedy(max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        eng.add_request("b", prompt="hi")


def test_text_prompt_and_stats_counters():
    eng = make_engine()
    eng.add_request("t", prompt="hello", params=greedy(max_tokens=3))
    out = run_all(eng)["t"]
    assert out.prompt_token_ids == ByteTok().encode("hello") and out.prompt == "hello"
    s = eng.stats()
    assert s["prompt_tokens_total"] == 5 and s["generation_tokens_total"] == 3
    assert s["kv_pool_tokens"] == 256 * 4 and s["kv_pages_used"] == 0 and s["layout"] == "tp"
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


async def _collect(agen, stop_after=None):
    outs = []
    async for o in agen:
        outs.append(o)
        if stop_after is not None and len(outs) >= stop_after:
            break
    return outs


def test_async_engine_keeps_one_snapshot_for_a_client_that_stops_reading():
    """A consumer that stops reading for 40+ steps holds one snapshot (the newest), not one per step;
    reading on resumes from it and the stream still ends with the whole, correct output."""
    async def main():
        eng = AsyncEngine(make_engine())
        try:
            agen = eng.generate([12, 13], greedy(max_tokens=200), "slow")
            n0 = len((await agen.__anext__()).outputs[0].token_ids)
            mailbox = eng._streams["slow"][1]
            while eng.stats()["generation_tokens_total"] < n0 + 40:  # the engine runs on without us
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert isinstance(mailbox._item, RequestOutput)  # exactly one unread snapshot, the newest
            assert len(mailbox._item.outputs[0].token_ids) >= n0 + 40
            rest = [o async for o in agen]
            assert len(rest[0].outputs[0].token_ids) >= n0 + 40 and rest[-1].finished
            assert rest[-1].outputs[0].token_ids == ref([12, 13], 200)
        finally:
            eng.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_engine_streams_aborts_and_surfaces_errors():
    async def main():
        eng = AsyncEngine(make_engine())
        try:
            outs = await _collect(eng.generate([12, 13], greedy(max_tokens=6), "a"))
            lens = [len(o.outputs[0].token_ids) for o in outs]  # cumulative; steps may merge if we lag
            assert lens == sorted(set(lens)) and lens[-1] == 6
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == ref([12, 13], 6)
            # Concurrent requests, one consumer leaves early: it is aborted and its pages freed.
            early = asyncio.create_task(_collect(eng.generate([14] * 9, greedy(max_tokens=200), "b"), 2))
            full = asyncio.create_task(_collect(eng.generate([15] * 3, greedy(max_tokens=20), "c")))
            b, c = await asyncio.gather(early, full)
            assert len(b) == 2 and c[-1].finished
            await eng.abort("b")
            assert eng.engine.allocator.num_used == [0]
            # Cancelling a consumer task aborts too.
            t = asyncio.create_task(_collect(eng.generate([16] * 5, greedy(max_tokens=10_000), "d")))
            await asyncio.sleep(0.05)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            await eng.abort("zzz")  # unknown id: a no-op, but it waits for the queue to drain
            assert eng.engine.allocator.num_used == [0] and not eng.engine.has_unfinished()
            with pytest.raises(ValueError, match="context"):
                await _collect(eng.generate([12] * 600, greedy(), "e"))
            assert eng.stats()["generation_tokens_total"] >= 26
        finally:
            eng.shutdown()

        bad = AsyncEngine(make_engine(fail_at_step=2))
        try:
            with pytest.raises(EngineError, match="simulated"):
                await _collect(bad.generate([12, 13], greedy(max_tokens=50), "f"))
            assert bad.engine.allocator.num_used == [0]
        finally:
            bad.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_engine_built_on_thread_builds_and_steps_on_one_thread():
    """`built_on_thread` (what `from_args` and the server use) runs the build and every step on the
    engine thread, never on the caller's: two OpenMP pools in one process slow every step (see its
    docstring). A build error reaches the caller with its own type."""
    import threading

    where: dict[str, set[int]] = {"build": set(), "step": set()}

    def build():
        where["build"].add(threading.get_ident())
        eng = make_engine()
        eng.on_step.append(lambda info: where["step"].add(threading.get_ident()))
        return eng

    async def main():
        eng = AsyncEngine.built_on_thread(build)
        try:
            outs = await _collect(eng.generate([12, 13], greedy(max_tokens=5), "a"))
            assert outs[-1].outputs[0].token_ids == ref([12, 13], 5)
        finally:
            eng.shutdown()
        assert len(where["build"]) == 1 and where["step"] == where["build"]
        assert threading.get_ident() not in where["build"]

    asyncio.run(asyncio.wait_for(main(), 60))

    def broken():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="nowhere"):
        AsyncEngine.built_on_thread(broken)


def test_idle_engine_takes_in_a_burst_of_requests_before_stepping():
    """Requests arriving close together at an idle engine are prefilled in one step (none runs a step
    ahead of its burst); a later lone request still runs after one gap."""
    rows: list[int] = []

    async def main():
        eng = AsyncEngine(make_engine())
        eng.arrival_gap_s = 0.25  # generous: arrivals below are 10 ms apart, even on a loaded machine
        eng.add_step_hook(lambda info: rows.append(info["rows"]))
        try:
            async def one(i):
                await asyncio.sleep(0.01 * i)
                return await _collect(eng.generate([12 + i, 13], greedy(max_tokens=3), f"b{i}"))

            outs = await asyncio.gather(*(one(i) for i in range(4)))
            assert [o[-1].outputs[0].token_ids for o in outs] == [ref([12 + i, 13], 3) for i in range(4)]
            assert rows[0] == 8  # the four 2-token prompts in the first step
            lone = await _collect(eng.generate([20, 21, 22], greedy(max_tokens=2), "lone"))
            assert lone[-1].outputs[0].token_ids == ref([20, 21, 22], 2)
            assert eng.engine.allocator.num_used == [0]
        finally:
            eng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
