"""Speculative decoding with n-gram drafts (splash/engine/spec.py), float64.

Greedy tokens with speculation on (k = 1..4 drafts) equal transformers' and the engine's without it,
and the logprobs reported are the target's (1e-9), with chunked prefill, the prefix cache, preemption
and an abort in flight, the books proved after every step; at T = 2 the same through a schedule that
switches the layout between speculative steps in all 12 directions, and seeded sampled runs are
identical to T = 1's (rank 0 alone draws). Rejection sampling's output distribution equals the
target's (chi-square on 40 000 draws). Configuration: SGLang's flags, vLLM's JSON, clear refusals.
"""

from __future__ import annotations

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference, serve_requests

from splash.config import EngineConfig
from splash.core.model_config import ConfigError
from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams
from splash.engine.spec import accept_greedy, accept_sampled, ngram_propose

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

# repetitive prompts (drafts are found) and plain ones (none are)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [3, 4, 3, 4, 3, 4, 3, 4, 3], list(range(10, 31)),
           [90, 1, 33, 4, 8, 61], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12]]
NEW = 20
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=12, device="cpu",
              speculative_policy="always")  # (every step its full depth: runs comparable step by step)
CIRCUIT = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
ALL12 = ",".join(f"{i + 2}:{lay}" for i, lay in enumerate(CIRCUIT[1:]))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint, transformers' greedy tokens, and the engine's without speculation."""
    path = build_checkpoint(tmp_path_factory.mktemp("spec") / "v3", "v3", seed=5)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    eng = build_engine(model=path, num_kv_pages=96, **ENGINE)
    try:
        plain = serve(eng, PROMPTS, greedy())
    finally:
        eng.shutdown()
    assert [o.token_ids for o in plain.values()] == ref, "the engine disagrees with transformers"
    return path, ref, plain


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3, **kw)


serve = serve_requests  # {prompt index: final output}, the books proved after every step


def same_logprobs(a, b) -> float:
    """Largest difference of the chosen tokens' logprobs (and the top ones both report)."""
    err = 0.0
    for x, y in zip(a.logprobs, b.logprobs):
        for t in x.keys() & y.keys():
            err = max(err, abs(x[t] - y[t]))
    return err


def test_ngram_proposals_and_greedy_acceptance():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]  # the 3-gram [1, 2, 3] matched
    assert ngram_propose([1, 2, 3, 4, 5, 7, 1, 2, 3], 3, 1, 4) == [4, 5, 7]
    assert ngram_propose([5, 1, 9, 9, 2, 1], 3, 1, 4) == [9, 9, 2]  # only the 1-gram matches
    assert ngram_propose([5, 1, 9, 9, 2, 1], 3, 2, 4) == []  # (min 2)
    assert ngram_propose([4, 4, 4], 5, 1, 2) == [4]  # the latest match: the continuation is cut
    assert ngram_propose([1, 2], 3, 1, 3) == [] and ngram_propose([], 3, 1, 3) == []
    assert accept_greedy([7, 8, 9], [7, 8]) == 2 and accept_greedy([7, 1, 9], [7, 8]) == 1
    assert accept_greedy([2, 8], [7]) == 0


def test_logprobs_of_a_verify_row_are_the_samplers():
    from splash.engine.spec import row_logprobs

    row = torch.randn(30, dtype=torch.float64)
    raw = SamplingParams(temperature=0.5, logprobs=2)
    sglang = SamplingParams(temperature=0.5, logprobs=2, logprob_temperature=True)
    got_raw, got_t = row_logprobs(row, 7, raw), row_logprobs(row, 7, sglang)
    assert got_raw[7] == pytest.approx(float(torch.log_softmax(row, -1)[7]), abs=1e-12)
    assert got_t[7] == pytest.approx(float(torch.log_softmax(row / 0.5, -1)[7]), abs=1e-12)
    assert len(got_raw) in (3, 2) and int(row.argmax()) in got_raw  # the chosen token and the top 2


def test_rejection_sampling_keeps_the_target_distribution():
    """Draws of (first, second) token from the accept/reject rule against the target's own p: the
    rule's marginals of the first token, and of the second one after an accepted first, equal p's."""
    g = torch.Generator().manual_seed(0)
    V = 6
    probs = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    draft = [int(probs[0].argmin()), 2]  # an unlikely first draft (rejections) and a likely-ish second
    n = 40_000
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        out = accept_sampled(probs, draft, g)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        m = counts.sum()
        chi2 = float(((counts - m * p) ** 2 / (m * p)).sum())
        assert chi2 < 20.5, f"chi-square {chi2:.1f} on {V - 1} degrees of freedom (p < 0.001 bound 20.5)"


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_speculation_equals_without(ckpt, k):
    path, ref, plain = ckpt
    eng = build_engine(model=path, num_kv_pages=96, speculative_algorithm="NGRAM",
                       speculative_num_draft_tokens=k + 1, **ENGINE)
    try:
        got = serve(eng, PROMPTS, greedy())
        verify, drafts, accepted = eng.spec_verify_ct, eng.spec_drafts, eng.spec_accepted
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == ref
    assert max(same_logprobs(got[i], plain[i]) for i in got) < 1e-9
    assert verify > 0 and 0 < accepted <= drafts <= k * verify, (verify, drafts, accepted)
    assert sum(len(o.token_ids) for o in got.values()) == len(PROMPTS) * NEW


def test_preemption_abort_and_prefix_cache_with_speculation(ckpt):
    """A pool that forces preemption, a shared prefix the cache serves, an abort mid-flight: the books
    hold after every step (SPLASH_CHECK_BOOKS in the suite), every finished answer is the plain one."""
    path, ref, plain = ckpt
    prompts = PROMPTS + [PROMPTS[0] + [40, 41], PROMPTS[4][:12]]
    eng = build_engine(model=path, num_kv_pages=30, speculative_algorithm="NGRAM", **ENGINE)
    try:
        got = serve(eng, prompts, greedy(), abort=(6, 2))
        stats = eng.stats()
        preempted = eng.scheduler.num_preemptions
    finally:
        eng.shutdown()
    assert preempted > 0, "the pool was meant to force preemption"
    assert stats["kv_pages_used"] == 0
    for i in range(len(PROMPTS)):
        if i == 2:
            assert got[2].finish_reason == "abort" and got[2].token_ids == ref[2][:len(got[2].token_ids)]
        else:
            assert got[i].token_ids == ref[i], i


@pytest.fixture(scope="module")
def group2():
    from splash.engine.group import RankGroup

    g = RankGroup.start(2, device="cpu", timeout_s=60.0, threads=1)
    yield g
    g.close()


@pytest.mark.slow
def test_switches_between_speculative_steps_change_nothing(group2, ckpt):
    path, ref, plain = ckpt
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=NEW, ignore_eos=True, seed=7, logprobs=1)
    one = build_engine(model=path, num_kv_pages=96, speculative_algorithm="NGRAM", **ENGINE)
    try:
        one_sampled = serve(one, PROMPTS, sampled)
    finally:
        one.shutdown()
    eng = build_engine(model=path, num_kv_pages=96, layout="tp", rank_group=group2, switch_schedule=ALL12,
                       speculative_algorithm="NGRAM", **ENGINE)
    try:
        got = serve(eng, PROMPTS, greedy())
        stats = eng.stats()
        verify = eng.spec_verify_ct
        eng.flush_cache()  # (as the fresh T = 1 engine: the same prefills, so the same drafts per step)
        two_sampled = serve(eng, PROMPTS, sampled)
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == ref
    assert max(same_logprobs(got[i], plain[i]) for i in got) < 1e-9
    assert stats["num_switches"] == 12 and verify > 0
    assert [o.token_ids for o in two_sampled.values()] == [o.token_ids for o in one_sampled.values()]


@pytest.mark.parametrize("kw,needle", [
    ({"speculative_algorithm": "MEDUSA"}, "unknown --speculative-algorithm"),
    ({"speculative_num_steps": 2}, "need --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 2, "speculative_num_draft_tokens": 4},
     "must be --speculative-num-steps"),
    ({"speculative_config": "{\"method\": \"ngram\", \"n\": 3}"}, "not supported"),
    ({"speculative_config": "{\"method\": \"ngram\", \"num_speculative_tokens\": 0}"}, ">= 1"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match": 5}, "is empty"),
])
def test_bad_speculative_options_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**kw)


def test_flags_and_vllm_json_mean_the_same():
    a = EngineConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=3,
                     speculative_ngram_max_match=3)
    b = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                        '"prompt_lookup_max": 3}')
    assert a.num_drafts == b.num_drafts == 2
    assert a.speculative_ngram_max_match == b.speculative_ngram_max_match == 3
    assert EngineConfig().num_drafts == 0 and EngineConfig(speculative_algorithm="NGRAM").num_drafts == 3


def test_server_reports_speculation():
    """`splash serve --speculative-algorithm NGRAM`: /get_server_info names it, /generate's meta_info
    carries SGLang's spec_verify_ct and spec_accept_length, /metrics counts verify slices and drafts."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from serve_utils import ServeProcess

    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--max-model-len", "512", "--num-kv-pages",
                        "48", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3"])
    try:
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 3
        r = httpx.post(srv.url + "/generate", timeout=120, json={
            # (most tokens occur once in the prompt: nearly every step finds a draft to verify)
            "input_ids": list(range(3, 250)), "sampling_params": {
                "temperature": 0, "max_new_tokens": 40, "ignore_eos": True}}).json()
        meta = r["meta_info"]
        assert meta["completion_tokens"] == 40 and meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] == pytest.approx(40 / meta["spec_verify_ct"])
        fams = {f.name: f.samples for f in text_string_to_metric_families(
            httpx.get(srv.url + "/metrics", timeout=30).text)}
        verify = sum(s.value for s in fams["splash:spec_verify"] if s.name.endswith("_total"))
        drafts = sum(s.value for s in fams["splash:spec_draft_tokens"] if s.name.endswith("_total"))
        assert verify >= meta["spec_verify_ct"] and drafts >= verify
        depth = [s.value for s in fams["splash:spec_depth"]]
        assert len(depth) == 1 and 0 <= depth[0] <= 2  # (the depth policy's current choice)
        assert info["speculative_policy"] == "auto"
    finally:
        srv.close()


@pytest.mark.parametrize("model", ["tiny-dsa", "tiny-glm5"])
def test_sparse_attention_models_speculate_exactly(model):
    """DeepSeek-V3.2's and GLM-5's sparse attention (an indexer's top-k per query row): verify rows pick
    their keys as decode rows would, so greedy tokens and logprobs equal the engine's without drafts."""
    prompts = [list(range(3, 60)), [5, 6, 7, 8, 9] * 8, list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = []
    for kw in ({}, {"speculative_algorithm": "NGRAM"}):
        eng = build_engine(model=model, num_kv_pages=256, **{**ENGINE, "max_num_batched_tokens": 16}, **kw)
        try:
            outs.append(serve(eng, prompts, params))
            verify = eng.spec_verify_ct
        finally:
            eng.shutdown()
    assert verify > 0
    assert [o.token_ids for o in outs[0].values()] == [o.token_ids for o in outs[1].values()]
    assert max(same_logprobs(outs[0][i], outs[1][i]) for i in outs[0]) < 1e-9


def oracle_proposer(eng, ref: dict[int, list[int]]):
    """Drafts from the known answer, in a rotating pattern: all right, right then wrong, all wrong (so
    verify steps accept everything, part, or nothing)."""
    calls = [0]

    def propose(seq, room):
        rid, n = int(seq.group.request_id), len(seq.output_token_ids)
        want = ref[rid][n:n + min(3, room)]
        calls[0] += 1
        kind = calls[0] % 3
        if kind == 1 or not want:
            return want
        if kind == 2:
            return want[:-1] + [(want[-1] + 1) % 200]
        return [(t + 1) % 200 for t in want]

    eng.scheduler.proposer = propose


@pytest.mark.parametrize("world", [1, 2])
def test_kda_hybrid_takes_rejected_drafts_back(world, group2):
    """Kimi-Linear hybrid: a verify step's rows advance the KDA state; on a rejection every rank puts
    back its snapshot and the accepted rows are replayed, so tokens and logprobs equal decoding without
    drafts (float64), whatever the drafts, through switches at T = 2 (which wait out verify steps)."""
    prompts = [[5, 6, 7, 8, 9] * 3, list(range(10, 31)), [90, 1, 33, 4, 8, 61]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    kw = dict(ENGINE, num_kv_pages=96)
    if world == 2:
        kw.update(rank_group=group2, layout="tp", switch_schedule="3:dp,5:cp,7:dop")
    plain = build_engine(model="tiny-hybrid", **kw)
    try:
        ref = serve(plain, prompts, params)
    finally:
        plain.shutdown()
    eng = build_engine(model="tiny-hybrid", speculative_algorithm="NGRAM", **kw)
    try:
        oracle_proposer(eng, {i: o.token_ids for i, o in ref.items()})
        got = serve(eng, prompts, params)
        stats = eng.stats()
        accepted, verify = eng.spec_accepted, eng.spec_verify_ct
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == [o.token_ids for o in ref.values()]
    assert max(same_logprobs(got[i], ref[i]) for i in got) < 1e-9
    assert verify > 6 and 0 < accepted < eng.spec_drafts and stats["state_slots_used"] == 0
    if world == 2:
        assert stats["num_switches"] == 3
