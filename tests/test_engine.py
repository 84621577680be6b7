"""The engine on a real (tiny, transformers-made) model in float64: greedy tokens identical to
transformers for 32 new tokens with chunked prefill, continuous batching admitting requests mid-run,
and after forced preemption; engine logprobs agree with transformers'; no page leaks."""

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_logits, hf_reference

from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams
from splash.llm import LLM

NEW = 32
PROMPTS = [[5, 6, 7], list(range(10, 31)), list(range(3, 12)), list(range(40, 77)), [90, 1, 33, 4, 8, 61]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("v3"), "v3", seed=0)
    hf = hf_reference(path)
    return path, hf, [hf_greedy(hf, p, NEW) for p in PROMPTS]


def greedy(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, **kw})


def drain(eng, final, on_step=None):
    n = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        n += 1
        if on_step:
            on_step(n)
    return final


def test_chunked_prefill_and_mid_run_admission_match_transformers(v3):
    path, hf, ref = v3
    eng = build_engine(model=path, dtype="float64", page_size=4, num_kv_pages=256, max_num_seqs=8,
                       max_num_batched_tokens=16, device="cpu")
    for i in (0, 1, 2):
        eng.add_request(f"r{i}", prompt_token_ids=PROMPTS[i], params=greedy(logprobs=0))
    mixed = []
    final = {}

    def admit(step):
        if step == 6:  # others are decoding by now: these join the running batch mid-run
            assert eng.stats()["num_running"] == 3
            for i in (3, 4):
                eng.add_request(f"r{i}", prompt_token_ids=PROMPTS[i], params=greedy(logprobs=0))
        if eng.scheduler.running:
            st = eng.stats()
            mixed.append(st["num_running"])

    drain(eng, final, admit)
    for i, p in enumerate(PROMPTS):
        out = final[f"r{i}"].outputs[0]
        assert out.token_ids == ref[i], f"prompt {i}"
        assert out.finish_reason == "length"
        # The engine's logprob of each chosen token equals transformers' full-sequence forward. Not to
        # 1e-9: both keep the MoE router in float32, and a float32 GEMM's summation order depends on
        # how many rows it multiplies (1 in decode, the whole sequence here), which moves gate
        # weights by ~1e-8 relative. Prefill-only logits are compared to 1e-9 in the model tests.
        lp = hf_logits(hf, p + out.token_ids[:-1]).log_softmax(-1)[len(p) - 1:]
        want = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor([d[t] for d, t in zip(out.logprobs, out.token_ids)], dtype=torch.float64)
        assert (got - want).abs().max() < 1e-6, (got - want).abs().max()
    assert max(mixed) == 5
    # The longest prompt (37 tokens) took several 16-token chunks.
    assert eng.stats()["steps"] > NEW + 37 // 16
    assert eng.allocator.num_used == [0] and eng.stats()["kv_pages_used"] == 0


def test_preemption_by_recompute_matches_transformers(v3):
    path, _, ref = v3
    # 24 pages of 4 tokens = 96 tokens for five requests that need 35..69 tokens each.
    eng = build_engine(model=path, dtype="float64", page_size=4, num_kv_pages=24, max_num_seqs=5,
                       max_num_batched_tokens=32, device="cpu")
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", prompt_token_ids=p, params=greedy())
    final = drain(eng, {})
    assert eng.scheduler.num_preemptions > 0
    for i in range(len(PROMPTS)):
        assert final[f"r{i}"].outputs[0].token_ids == ref[i], f"prompt {i}"
    assert eng.allocator.num_used == [0]


def test_llm_api_abort_and_errors_free_pages(v3, monkeypatch):
    path, _, ref = v3
    llm = LLM(model=path, dtype="float64", page_size=4, num_kv_pages=128, max_num_batched_tokens=24,
              device="cpu")
    outs = llm.generate(prompt_token_ids=PROMPTS[:4], sampling_params=greedy())
    assert [o.outputs[0].token_ids for o in outs] == ref[:4]
    assert all(o.finished and o.prompt_token_ids == p for o, p in zip(outs, PROMPTS))
    eng = llm.llm_engine
    # Abort mid-run.
    eng.add_request("a", prompt_token_ids=PROMPTS[3], params=greedy())
    eng.step()
    eng.step()
    assert eng.allocator.num_used[0] > 0
    assert eng.abort("a").outputs[0].finish_reason == "abort"
    assert eng.allocator.num_used == [0]
    # A failing step inside generate: the error propagates and every page comes back.
    calls = {"n": 0}
    real = eng.runner.execute

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(plan)

    monkeypatch.setattr(eng.runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())
    assert eng.allocator.num_used == [0] and not eng.has_unfinished()
    # The engine still works afterwards.
    monkeypatch.setattr(eng.runner, "execute", real)
    again = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=greedy())
    assert again[0].outputs[0].token_ids == ref[0]
    # Ids must be integers (1.7 was cut to 1); arrays and tensors of ids are fine.
    for bad in ([5, 6.7], [5, True], [5, None]):
        with pytest.raises(ValueError, match="prompt_token_ids must be integers"):
            eng.add_request("bad", prompt_token_ids=bad, params=greedy())
    import numpy as np

    for ids in (np.array(PROMPTS[0]), torch.tensor(PROMPTS[0])):
        out = llm.generate(prompt_token_ids=[ids], sampling_params=greedy())
        assert out[0].outputs[0].token_ids == ref[0]
    assert eng.allocator.num_used == [0]


def test_batched_decode_attention_equals_per_slice_kernel(v3):
    """The runner's batched decode path against the shared per-slice kernel, on mixed steps."""
    from splash.attention.local import LocalLayout

    path, _, _ = v3
    runs = []
    for layout in ("batched", "local"):
        eng = build_engine(model=path, dtype="float64", page_size=4, num_kv_pages=256, max_num_seqs=8,
                           max_num_batched_tokens=12, device="cpu")
        if layout == "local":
            eng.runner.layout = LocalLayout()
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", prompt_token_ids=p, params=greedy(max_tokens=10, logprobs=3))
        runs.append(drain(eng, {}))
    for rid, out in runs[0].items():
        other = runs[1][rid].outputs[0]
        assert out.outputs[0].token_ids == other.token_ids
        for a, b in zip(out.outputs[0].logprobs, other.logprobs):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-12


def test_vllm_tensor_parallel_size_is_the_rank_count():
    from splash.core.model_config import ConfigError

    with pytest.raises(ConfigError, match="disagrees"):
        LLM("tiny", tensor_parallel_size=2, tp=1, device="cpu")
    with LLM("tiny", tensor_parallel_size=1, device="cpu", num_kv_pages=8) as llm:
        assert llm.stats()["ranks"] == 1
