"""Prefill/decode disaggregation in the engine, over Mooncake's transfer engine (TCP on loopback).

Two T = 1 engines in one process, each with its own transfer engine: the prefill engine runs each prompt
(max_tokens 1) and writes its KV - every store: the latent, a DSA model's indexer keys, a KDA hybrid's
recurrent and conv state, an FP8 cache as bytes - into the pages (and slot) the decode engine reserved;
the decode engine commits the first token and decodes. Checked: float64 greedy tokens equal one
colocated engine's on the same checkpoint and options, logprobs to 1e-12 (the two runs batch rows
differently), the books balance on both sides after every step; a write to a peer that is gone fails
that request only and the decode side frees its pages; a handshake between engines that differ (page
size, dtype) names the difference; the AsyncEngine calls the server makes, end to end.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed (make setup)")

from splash.engine.build import build_engine  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402
from splash.engine.stages.pd import PDNoRoom  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [list(range(10, 31)), [5, 6, 7], list(range(3, 20)), [90, 1, 33, 4, 8, 61, 9, 9, 13, 60, 12, 50]]
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=16, device="cpu",
              check_books=True, num_kv_pages=64)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def colocated(model: str, params: SamplingParams = PARAMS, **kw) -> dict[str, tuple[list[int], list]]:
    eng = build_engine(model, **{**ENGINE, **kw})
    try:
        for i, ids in enumerate(PROMPTS):
            eng.add_request(f"r{i}", params=params, prompt_token_ids=ids)
        got = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
                    if params.prompt_logprobs is not None:
                        got[o.request_id] += (o.prompt_logprobs,)
        return got
    finally:
        eng.shutdown()


def disaggregated(pre, dec, params: SamplingParams = PARAMS) -> dict[str, tuple[list[int], list]]:
    """Every prompt reserved on `dec`, prefilled on `pre` (its KV written into `dec`), decoded on `dec`."""
    results: dict[str, dict] = {}
    for i, ids in enumerate(PROMPTS):
        dest = dec.pd.reserve(f"r{i}", ids, params)
        pre.pd.add_prefill(f"r{i}", ids, params, dest, lambda r: results.__setitem__(r["request_id"], r))
    while pre.has_unfinished():
        pre.step()
    assert pre.stats()["kv_pages_used"] == 0 or pre.allocator.cache is not None
    got = {}
    for rid, r in sorted(results.items()):
        assert r["error"] is None, r
        assert r["bytes"] > 0
        for o in dec.pd.arrived(rid, r["first_token"], r["logprobs"], r["prompt_logprobs"], r["drafts"]):
            if o.finished:
                got[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
    while dec.has_unfinished():
        for o in dec.step():
            if o.finished:
                got[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
                if params.prompt_logprobs is not None:
                    got[o.request_id] += (o.prompt_logprobs,)
    for eng in (pre, dec):
        assert not eng.scheduler.book_errors()
        assert not eng.requests and not eng.scheduler.parked
    return got


@pytest.mark.parametrize("model,kw", [("tiny", {}), ("tiny-dsa", {}), ("tiny-glm5", {}), ("tiny-hybrid", {}),
                                      ("tiny", {"kv_cache_dtype": "fp8_ds_mla"})],
                         ids=["tiny", "tiny-dsa", "tiny-glm5", "tiny-hybrid", "tiny-fp8"])
def test_disaggregated_equals_colocated(model, kw):
    ref = colocated(model, **kw)
    pre, dec = build_engine(model, **{**ENGINE, **kw}), build_engine(model, **{**ENGINE, **kw})
    try:
        if model == "tiny" and not kw:
            got = _recording_writes(pre, dec)[0]
        else:
            got = disaggregated(pre, dec)
        assert pre.stats()["kv_transfer_bytes_total"] == dec.stats()["kv_transfer_bytes_total"] > 0
    finally:
        pre.shutdown()
        dec.shutdown()
    assert_same(got, ref)


def _recording_writes(pre, dec):
    """`disaggregated` on a decode whose free pages were churned first (twelve taken one at a time, given
    back odd ones first), recording each write's page lists: every reservation is still one run of
    pages (the allocator joins freed neighbours and hands out runs), and the prefill's piece count is one
    per run of (source, destination) pages per store and layer."""
    from splash.disagg.transfer import KVTransfer, _runs

    a = dec.allocator.ranks[0]
    got = [a.alloc(1)[0] for _ in range(12)]
    a.free(got[1::2] + got[0::2])
    writes: list[tuple[list[int], list[int]]] = []
    orig = KVTransfer.write

    def write(self, peer, src, dst, *args, **kw):
        writes.append((list(src), list(dst)))
        return orig(self, peer, src, dst, *args, **kw)

    KVTransfer.write = write
    try:
        out = disaggregated(pre, dec)
    finally:
        KVTransfer.write = orig
    per_page = sum(t.shape[0] for t in pre.pd.ranks.local().pool.tensors())  # (stores x layers)
    assert len(writes) == len(PROMPTS)
    assert all(d == list(range(d[0], d[0] + len(d))) for _, d in writes), writes
    assert pre.stats()["kv_transfer_pieces_total"] == sum(len(_runs(s, d)) for s, d in writes) * per_page
    return out, writes


def test_mtp_draft_kv_and_first_chain_travel(tmp_path):
    """MTP on both sides: the prefill runs its draft phase for the finished prompt (pages held past it),
    so the last chunk's draft KV goes with the rest (the latent store's MTP layer) and its chain is the
    decode's first drafts. Every chain equals a colocated MTP engine's (each reads the prompt's draft
    KV; the random draft layer accepts none, so this is what shows the draft KV right), tokens and
    logprobs too, and so do the verify steps and accepted drafts (no prompt is
    chunked here: a colocated prompt whose last chunk is one token also verifies drafts on it, which a
    max_tokens 1 prefill does not)."""
    import dataclasses

    from splash.core.presets import PRESETS
    from splash.model.tiny import write_tiny_model

    path = str(write_tiny_model(tmp_path / "tiny-mtp", seed=3,
                                cfg=dataclasses.replace(PRESETS["tiny"], num_nextn_predict_layers=1)))
    kw = dict(speculative_algorithm="MTP", speculative_policy="always", max_num_batched_tokens=64)
    ref_eng = build_engine(path, **{**ENGINE, **kw})
    try:
        ref, chains = {}, {}
        for i, ids in enumerate(PROMPTS):
            ref_eng.add_request(f"r{i}", params=PARAMS, prompt_token_ids=ids)
        while ref_eng.has_unfinished():
            for o in ref_eng.step():
                if o.finished:
                    ref[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
            chains.update(_chains(ref_eng))
        want = {k: ref_eng.stats()[k] for k in ("spec_verify_ct", "spec_accepted_tokens")}
    finally:
        ref_eng.shutdown()
    pre, dec = build_engine(path, **{**ENGINE, **kw}), build_engine(path, **{**ENGINE, **kw})
    try:
        assert pre.pd.layout_info()["stores"][0]["shape"][0] == len(pre.runner.pool.latent_layers) == 5
        seen, arrived, step = {}, dec.pd.arrived, dec.step
        dec.pd.arrived = lambda rid, *a: (seen.update({(rid, 1): a[3][0]}), arrived(rid, *a))[1]
        dec.step = lambda: (step(), seen.update(_chains(dec)))[0]
        got = disaggregated(pre, dec)
        assert seen == chains and len(chains) == 4 * len(PROMPTS)  # (max_tokens 6: drafts after 1..4)
        assert pre.stats()["spec_verify_ct"] == 0 and want["spec_verify_ct"] > 0
        assert {k: dec.stats()[k] for k in want} == want
    finally:
        pre.shutdown()
        dec.shutdown()
    assert_same(got, ref)


def _chains(eng) -> dict[tuple[str, int], list[int]]:
    """The MTP chains `eng` holds for its next step, by (request, tokens out)."""
    return {(s.group.request_id, len(s.output_token_ids)): c for s, c in eng.speculation.mtp.drafts.items()}


def assert_same(got, ref, tol: float = 1e-12) -> None:
    """Tokens equal; logprobs to `tol` (the two runs batch rows differently: a sum's order may differ)."""
    assert sorted(got) == sorted(ref)
    for rid, (toks, lps, *prompt) in ref.items():
        assert got[rid][0] == toks, rid
        assert len(got[rid]) == 2 + len(prompt), rid  # (+ the prefill side's prompt logprobs)
        for a, b in zip(got[rid][1], lps, strict=True):
            assert_close(a, b, tol, rid)
        for pa, pb in zip(got[rid][2:], prompt, strict=True):
            assert (pa is None) == (pb is None), rid
            for a, b in zip(pa or [], pb or [], strict=True):
                assert (a is None) == (b is None) and (a is None or assert_close(a, b, tol, rid))


def assert_close(a: dict, b: dict, tol: float, rid: str) -> bool:
    """Two {token: logprob} dicts: the same tokens, logprobs to `tol` (float64 rows batched differently
    may sum in another order: ~1e-16 apart on some CPUs' GEMMs, never more than the standard's 1e-9)."""
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol for k in a), (rid, a, b)
    return True


def test_dead_peer_fails_one_request_and_frees_its_pages():
    pre, dec = build_engine("tiny", **ENGINE), build_engine("tiny", **ENGINE)
    try:
        ids = PROMPTS[0]
        free = dec.allocator.num_free
        dest = dec.pd.reserve("gone", ids, PARAMS)
        assert dec.allocator.num_free != free and not dec.scheduler.book_errors()
        dec.pd.close()  # the decode side's memory is gone (as when its process dies)
        results: dict[str, dict] = {}
        pre.pd.add_prefill("gone", ids, PARAMS, dest, lambda r: results.__setitem__(r["request_id"], r))
        while pre.has_unfinished():
            pre.step()
        assert results["gone"]["error"] and "failed" in results["gone"]["error"]
        assert not pre.requests and not pre.scheduler.book_errors()
        out = dec.pd.fail("gone", results["gone"]["error"])
        assert out is not None and out.outputs[0].finish_reason == "abort"
        assert dec.allocator.num_free == free and not dec.requests and not dec.scheduler.book_errors()
        assert dec.pd.arrived("gone", 1, None) == []  # (too late: nothing happens)
    finally:
        pre.shutdown()
        dec.shutdown()


def test_reserve_without_room_and_abort_while_parked():
    dec = build_engine("tiny", **{**ENGINE, "num_kv_pages": 8})
    try:
        dec.pd.reserve("a", list(range(20)), PARAMS)  # 5 of 8 pages
        with pytest.raises(PDNoRoom):
            dec.pd.reserve("b", list(range(20)), PARAMS)
        assert "b" not in dec.requests and not dec.scheduler.book_errors()
        assert not dec.has_unfinished()  # a parked request waits for its KV, not for a step
        assert dec.abort("a") is not None  # (the client left: the prefill may still write into its pages)
        assert dec.allocator.num_free == [3] and dec.stats()["pd_draining"] == 1
        assert not dec.scheduler.book_errors() and not dec.has_unfinished()
        dec.scheduler.expire(float("inf"))  # (DRAIN_S later)
        assert dec.allocator.num_free == [8] and not dec.scheduler.book_errors()
    finally:
        dec.shutdown()


def test_releasing_kv_memory_fails_waiting_requests_and_refuses_writes():
    """release_memory_occupation on a decode with requests waiting for their KV (an RL trainer taking the
    memory back): they fail at once and their pages are freed, the memory is unregistered before it goes
    (a prefill's write then fails cleanly, never lands in freed memory), and no destination is handed out
    until it is resumed; after the resume the pair works again."""
    pre, dec = build_engine("tiny", **ENGINE), build_engine("tiny", **ENGINE, enable_memory_saver=True)
    try:
        ids = PROMPTS[0]
        free = dec.allocator.num_free
        waiting = dec.pd.reserve("w", ids, PARAMS)
        dec.abort(dec.pd.reserve("a", PROMPTS[1], PARAMS)["request_id"])  # (pages held: a late write)
        dec.release_memory_occupation(["kv_cache"])
        assert not dec.requests and not dec.scheduler.parked and not dec.scheduler.draining
        assert not dec.scheduler.book_errors() and dec.stats()["kv_transfer_failures_total"] == 1
        with pytest.raises(PDNoRoom, match="released"):  # (the server's reserve retries until resumed)
            dec.pd.reserve("x", ids, PARAMS)
        results: dict[str, dict] = {}
        pre.pd.add_prefill("w", ids, PARAMS, waiting, lambda r: results.__setitem__(r["request_id"], r))
        while pre.has_unfinished():
            pre.step()
        assert results["w"]["error"] and not pre.requests and not pre.scheduler.book_errors()
        dec.resume_memory_occupation(["kv_cache"])
        assert dec.allocator.num_free == free
        got = disaggregated(pre, dec)  # (a new transfer session on the decode side)
    finally:
        pre.shutdown()
        dec.shutdown()
    assert_same(got, colocated("tiny"))


@pytest.mark.parametrize("kw,named", [({"page_size": 8}, "page_size"), ({"dtype": "float32"}, "dtype")])
def test_handshake_names_the_difference(kw, named):
    pre, dec = build_engine("tiny", **ENGINE), build_engine("tiny", **{**ENGINE, **kw})
    try:
        dest = dec.pd.reserve("x", PROMPTS[1], PARAMS)
        with pytest.raises(ValueError, match=named):
            pre.pd.add_prefill("x", PROMPTS[1], PARAMS, dest)
        assert not pre.requests and not pre.scheduler.book_errors()
        dec.pd.fail("x", "handshake")
        assert not dec.scheduler.book_errors()
    finally:
        pre.shutdown()
        dec.shutdown()


def test_async_calls_end_to_end():
    """The calls the servers make (AsyncEngine's pd_*), on two engine threads: tokens as colocated; a
    stream left while its KV has not arrived frees the reserved pages."""
    import asyncio

    from splash.engine.async_engine import AsyncEngine

    ref = colocated("tiny")
    pre = AsyncEngine.built_on_thread(lambda: build_engine("tiny", **ENGINE))
    dec = AsyncEngine.built_on_thread(lambda: build_engine("tiny", **ENGINE))

    async def one(i: int, ids: list[int]):
        rid = f"r{i}"
        dest = await dec.pd_reserve(rid, ids, PARAMS)
        out, res = await pre.pd_prefill(rid, ids, PARAMS, dest)
        assert res["error"] is None and out.outputs[0].token_ids == [res["first_token"]]
        await dec.pd_arrived(rid, res["first_token"], res["logprobs"])
        outs = [o async for o in dec.pd_stream(rid)]
        last = outs[-1]
        assert last.finished
        return rid, (last.outputs[0].token_ids, last.outputs[0].logprobs)

    async def left_early():
        await dec.pd_reserve("left", PROMPTS[0], PARAMS)
        gen = dec.pd_stream("left")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()  # (the client went away: the stream's finally aborts the request)
        with pytest.raises(asyncio.CancelledError):
            await task
        await dec.call(lambda eng: None)  # (the abort was queued before this)
        return await dec.call(lambda eng: (eng.allocator.num_free, eng.scheduler.book_errors(),
                                           list(eng.requests)))

    async def main():
        got = dict(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(PROMPTS))))
        return got, await left_early()

    try:
        got, (free, errs, live) = asyncio.run(main())
    finally:
        pre.shutdown()
        dec.shutdown()
    assert_same(got, ref)
    assert free == [64 - 6] and not errs and not live  # (its pages drain: the prefill might still write)


def test_seeded_sampling_and_prompt_logprobs():
    """A seeded random request: the decode side's generator is advanced past the prefill's draw of the
    first token, so every token is the colocated engine's; prompt logprobs (computed by the prefill side,
    reported by the decode side) too."""
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=7, logprobs=1, prompt_logprobs=2)
    ref = colocated("tiny", params)
    pre, dec = build_engine("tiny", **ENGINE), build_engine("tiny", **ENGINE)
    try:
        got = disaggregated(pre, dec, params)
    finally:
        pre.shutdown()
        dec.shutdown()
    assert_same(got, ref)


def test_bad_destination_fails_that_request_only():
    """A destination outside the peer's pool fails its own request in the step; the other one in the
    same step is sent and decodes as colocated."""
    ref = colocated("tiny")
    pre, dec = build_engine("tiny", **ENGINE), build_engine("tiny", **ENGINE)
    try:
        results: dict[str, dict] = {}
        done = lambda r: results.__setitem__(r["request_id"], r)  # noqa: E731
        good = dec.pd.reserve("r0", PROMPTS[0], PARAMS)
        bad = dec.pd.reserve("r1", PROMPTS[1], PARAMS)
        pre.pd.add_prefill("r0", PROMPTS[0], PARAMS, good, done)
        pre.pd.add_prefill("r1", PROMPTS[1], PARAMS, {**bad, "pages": [10 ** 6], "table": [[10 ** 6]]}, done)
        while pre.has_unfinished():
            pre.step()
        assert results["r0"]["error"] is None and "outside the peer's pool" in results["r1"]["error"]
        dec.pd.fail("r1", results["r1"]["error"])
        outs = dec.pd.arrived("r0", results["r0"]["first_token"], results["r0"]["logprobs"])
        while dec.has_unfinished():
            outs = dec.step() or outs
        assert outs[-1].outputs[0].token_ids == ref["r0"][0]
        assert not dec.scheduler.book_errors() and not pre.scheduler.book_errors()
        assert dec.allocator.num_free == [64] or dec.allocator.cache is not None
    finally:
        pre.shutdown()
        dec.shutdown()


def _all_outputs(outs, got: dict) -> None:
    for o in outs:
        if o.finished:
            got[o.request_id] = [(c.token_ids, c.logprobs) for c in sorted(o.outputs, key=lambda c: c.index)]


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
    SamplingParams(n=4, temperature=0.9, top_p=0.9, max_tokens=5, seed=11, ignore_eos=True, logprobs=1)],
    ids=["greedy", "seeded"])
def test_n_sequences_prefilled_once_written_into_n_destinations(params):
    """n > 1 (an RL group): the decode side reserves pages for each sequence, the prefill side runs them
    as a colocated engine does (prefix cache on: the prompt's full pages computed once) and writes each
    into its own pages; sequence i continues from first token i. Every sequence's tokens and logprobs
    equal the colocated engine's; the books balance on both sides."""
    prompts = PROMPTS[:2]
    ref: dict = {}
    eng = build_engine("tiny", **ENGINE)
    try:
        for i, ids in enumerate(prompts):
            eng.add_request(f"r{i}", params=params, prompt_token_ids=ids)
        while eng.has_unfinished():
            _all_outputs(eng.step(), ref)
    finally:
        eng.shutdown()
    pre, dec = build_engine("tiny", **ENGINE), build_engine("tiny", **ENGINE)
    try:
        assert pre.allocator.cache is not None  # (the prompt computed once, its full pages shared)
        results: dict[str, dict] = {}
        for i, ids in enumerate(prompts):
            dest = dec.pd.reserve(f"r{i}", ids, params)
            assert len(dest["seqs"]) == params.n and dest["seqs"][0]["pages"] == dest["pages"]
            pre.pd.add_prefill(f"r{i}", ids, params, dest, lambda r: results.__setitem__(r["request_id"], r))
        while pre.has_unfinished():
            pre.step()
        got: dict = {}
        for rid, r in sorted(results.items()):
            assert r["error"] is None and len(r["first_tokens"]) == params.n, r
            if params.greedy:
                assert len(set(r["first_tokens"])) == 1
            _all_outputs(dec.pd.arrived(rid, r["first_tokens"], r["first_logprobs"]), got)
        while dec.has_unfinished():
            _all_outputs(dec.step(), got)
        assert pre.stats()["kv_transfer_bytes_total"] == dec.stats()["kv_transfer_bytes_total"] > 0
        assert pre.stats()["kv_transfers_total"] == len(prompts) * params.n
        for e in (pre, dec):
            assert not e.scheduler.book_errors() and not e.requests and not e.scheduler.parked
        assert dec.allocator.num_free == [64]
    finally:
        pre.shutdown()
        dec.shutdown()
    assert sorted(got) == sorted(ref)
    for rid, seqs in ref.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in seqs], rid
        for (_, a), (_, b) in zip(got[rid], seqs, strict=True):
            assert len(a) == len(b), rid
            for x, y in zip(a, b):
                assert (x is None) == (y is None) and (x is None or assert_close(x, y, 1e-12, rid))


def test_n_sequences_reserve_all_or_nothing():
    """n = 3 of 5 pages each on 12 free pages: two would fit, so none is held (PDNoRoom), the books
    balance; a prefill told n = 2 for a 3-sequence destination refuses it (the sides disagree on n); a
    write that fails for one of the n fails the request once, and both sides' books balance."""
    dec = build_engine("tiny", **{**ENGINE, "num_kv_pages": 12})
    pre = build_engine("tiny", **ENGINE)
    try:
        many = SamplingParams(n=3, temperature=0.0, max_tokens=1)
        with pytest.raises(PDNoRoom):
            dec.pd.reserve("a", list(range(20)), many)
        assert dec.allocator.num_free == [12] and not dec.requests and not dec.scheduler.book_errors()
        dest = dec.pd.reserve("b", list(range(8)), many)  # (2 pages each)
        with pytest.raises(ValueError, match="disagree on n"):
            pre.pd.add_prefill("b", list(range(8)), SamplingParams(n=2, temperature=0.0, max_tokens=1), dest)
        # one of the n destinations outside the peer's pool: the request fails whole, reported once
        results: list[dict] = []
        bad = {**dest, "seqs": [dest["seqs"][0], {"pages": [10 ** 6] * 2, "slot": -1}, dest["seqs"][2]]}
        pre.pd.add_prefill("b", list(range(8)), many, bad, results.append)
        while pre.has_unfinished():
            pre.step()
        assert len(results) == 1 and "outside the peer's pool" in results[0]["error"]
        assert not pre.requests and not pre.scheduler.book_errors() and not pre.pd.prefill.jobs
        dec.pd.fail("b", results[0]["error"])
        assert dec.allocator.num_free == [12] and not dec.scheduler.book_errors() and not dec.requests
    finally:
        pre.shutdown()
        dec.shutdown()
