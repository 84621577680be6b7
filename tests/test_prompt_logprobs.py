"""Prompt logprobs (vLLM's `prompt_logprobs`, SGLang's `logprob_start_len`, OpenAI's `echo`) in float64
against transformers' full-sequence forward (1e-9): one rank, and two ranks in every layout, through
chunked prefill (8-token chunks over 19-token prompts), n = 2, a start position, a live switch in the
middle of a prefill and a retract that recomputes the prompt; requests that did not ask get none and
the same tokens. The sampler's top-p replay (kept set, renormalised logprob) on hand-made logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_logits, hf_reference

from splash.engine.build import build_engine
from splash.engine.group import RankGroup
from splash.engine.sampler import Sampler, SampleRow
from splash.engine.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [list(range(10, 29)), [90, 1, 33, 4, 8, 61, 17], [5, 6, 7, 40, 41, 2, 9, 77, 3, 12, 50]]
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=8, device="cpu",
              num_kv_pages=96)
LAYOUTS = ("tp", "dp", "cp", "dop")
TOP = 3
TOL = 1e-9


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(checkpoint, per prompt: transformers' log-softmax rows [P, V] of the prompt itself)."""
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3", seed=3)
    hf = hf_reference(path)
    return path, [torch.log_softmax(hf_logits(hf, p), -1) for p in PROMPTS]


@pytest.fixture(scope="module")
def group():
    g = RankGroup.start(2, device="cpu", timeout_s=60.0, threads=1)
    yield g
    g.close()


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **kw)


def run(eng, on_step=None) -> dict:
    """Each prompt twice: with prompt logprobs (n = 2; the last prompt from position 2 on) and without."""
    for i, p in enumerate(PROMPTS):
        start = 2 if i == len(PROMPTS) - 1 else 0
        eng.add_request(f"lp{i}", prompt_token_ids=p,
                        params=params(n=2, prompt_logprobs=TOP, prompt_logprobs_start=start))
        eng.add_request(f"no{i}", prompt_token_ids=p, params=params())
    done, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if on_step is not None:
            on_step(eng, steps)
    return done


def check(done: dict, ref_lps: list[torch.Tensor], what: str) -> None:
    for i, (p, lps) in enumerate(zip(PROMPTS, ref_lps)):
        got, plain = done[f"lp{i}"], done[f"no{i}"]
        assert plain.prompt_logprobs is None, what
        assert [o.token_ids for o in got.outputs] == [plain.outputs[0].token_ids] * 2, what
        start = 2 if i == len(PROMPTS) - 1 else 0
        pl = got.prompt_logprobs
        assert len(pl) == len(p) and all(x is None for x in pl[:max(start, 1)]), what
        for pos in range(max(start, 1), len(p)):
            row, d = lps[pos - 1], pl[pos]
            assert abs(d[p[pos]] - float(row[p[pos]])) < TOL, f"{what}: position {pos}"
            top_v, top_i = row.topk(TOP)
            for t, v in zip(top_i.tolist(), top_v.tolist()):
                assert abs(d[t] - v) < TOL, f"{what}: top of position {pos}"
            assert len(d) <= TOP + 1


def test_prompt_logprobs_at_one_rank(ref):
    path, lps = ref
    eng = build_engine(model=path, **ENGINE)
    try:
        check(run(eng), lps, "T1")

        def retract(e, step: int) -> None:  # mid-prefill: the prompt is recomputed, kept once
            if step == 2:
                e.pause_generation("retract")
                e.continue_generation()
        check(run(eng, retract), lps, "T1 retract")
        with pytest.raises(ValueError, match="start below 3"):
            eng.add_request("bad", prompt_token_ids=[1, 2, 3], params=params(prompt_logprobs=0,
                                                                            prompt_logprobs_start=3))
        assert not eng.has_unfinished()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompt_logprobs_in_every_layout_at_two_ranks(ref, group, layout):
    path, lps = ref
    nxt = LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)]
    eng = build_engine(model=path, layout=layout, rank_group=group, **ENGINE)
    try:
        # the first prefill chunks run in `layout`, the rest in the next one (switched live at step 1)
        before = eng.switcher.stats()["num_switches"]
        check(run(eng, lambda e, s: s == 1 and e.switcher.request(nxt)), lps, f"T2 {layout} -> {nxt}")
        assert eng.switcher.stats()["num_switches"] == before + 1
        assert eng.kv_pool_tokens > 0 and eng.stats()["kv_pages_used"] == 0
    finally:
        eng.shutdown()


def test_top_p_replay_in_the_sampler():
    """The kept set is the nucleus the draw came from; logprobs renormalise over it (temperature on)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.1, 3.0, 0.0, 0.2, 0.3]], dtype=torch.float64)
    p = SamplingParams(temperature=0.7, top_p=0.8, seed=1, logprobs=2, logprob_temperature=True,
                       return_top_p_token_ids=True)
    g = SamplingParams(temperature=0.0, logprobs=0, logprob_temperature=True, return_top_p_token_ids=True)
    out = Sampler()(logits, [SampleRow(p, 0, torch.Generator().manual_seed(1)), SampleRow(g, 0)])
    probs = torch.softmax(logits[0] / 0.7, -1)
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, []
    for t in order:  # SamplingParams' rule: keep while the mass strictly before a token is below top_p
        if mass >= 0.8 and nucleus:
            break
        nucleus.append(t)
        mass += float(probs[t])
    assert out[0].top_p_ids == nucleus and out[0].token_id in nucleus
    z = float(probs[nucleus].sum())
    for t, lp in out[0].logprobs.items():
        assert math.isclose(lp, math.log(float(probs[t]) / z), rel_tol=1e-12)
    assert out[1].top_p_ids == [1] and out[1].token_id == 1  # greedy: the token itself, raw logprob
    assert math.isclose(out[1].logprobs[1], float(torch.log_softmax(logits[1], -1)[1]), rel_tol=1e-12)
    with pytest.raises(ValueError, match="needs top_p < 1"):
        SamplingParams(return_top_p_token_ids=True)
