"""Kimi-Linear hybrids (MLA + KDA) on one rank, float64, against transformers.

The model: prefill in chunks (the chunked form, across chunk boundaries) and one-token decode (the
recurrent form) give transformers' logits (its KDA core in float64, `helpers_kda`) to 1e-9; the
unpatched reference's greedy tokens too. The engine: chunked prefill with requests admitted mid-run,
state slots bounding admission, preemption (the state recomputed from the tokens), abort, a weight
update (stale state never read) and the built-in `tiny-hybrid`; no slot or page leaks (the prefix cache
of hybrids, with state snapshots: tests/test_prefix_hybrid.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers_ckpt import Seq, SimpleRunner, hf_greedy, hf_logits
from helpers_kda import build_kimi, kda_core_float64, kimi_reference

from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 12
PROMPTS = [[5, 6, 7], list(range(10, 31)), list(range(3, 12)), list(range(40, 77)), [90, 1, 33, 4, 8, 61]]
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, device="cpu")


def _delta_inputs(h: int, n: int, d: int, dtype: torch.dtype, steep: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = torch.nn.functional.normalize(rnd(h, n, d), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(rnd(h, n, d), dim=-1)
    g = -torch.rand(h, n, d, generator=gen, dtype=dtype) * steep
    return q, k, rnd(h, n, d), g, torch.rand(h, n, generator=gen, dtype=dtype), rnd(h, d, d)


@pytest.mark.parametrize("steep", [0.05, 5.0, 60.0], ids=["gentle", "midpoint-factored", "sub-blocked"])
@pytest.mark.parametrize("n", [1, 7, 64, 65, 150])
def test_chunked_form_equals_the_recurrence_row_by_row(n, steep):
    """The chunked form (a chunk's decay factored about its midpoint, or sub-blocked where it spans too
    much to factor) gives the recurrent form's outputs and final state, in float64 to 1e-12; in float32
    a steep decay stays finite (no exp overflow) and within float32 rounding."""
    from splash.model.kda import chunked_delta_rule, recurrent_delta_rule

    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        q, k, v, g, beta, S = _delta_inputs(3, n, 8, dtype, steep)
        out, state = chunked_delta_rule(q, k, v, g, beta, S)
        rows, st = [], S[None]
        for i in range(n):
            o, st = recurrent_delta_rule(q[None, :, i], k[None, :, i], v[None, :, i], g[None, :, i],
                                         beta[None, :, i], st)
            rows.append(o[0])
        assert torch.isfinite(out).all() and torch.isfinite(state).all()
        assert (out - torch.stack(rows, 1)).abs().max() < tol, f"{dtype}: outputs"
        assert (state - st[0]).abs().max() < tol, f"{dtype}: state"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(checkpoint, reference model, greedy tokens with the float64 core, unpatched greedy tokens)."""
    path = build_kimi(tmp_path_factory.mktemp("kimi") / "k", seed=0)
    hf = kimi_reference(path)
    plain = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    with kda_core_float64():
        ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, hf, ref, plain


def greedy(new: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": new, "ignore_eos": True, **kw})


def drain(eng, on_step=None) -> dict[str, object]:
    final = {}
    while eng.has_unfinished():
        if on_step:
            on_step(eng)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def idle(eng) -> None:
    st = eng.stats()
    assert st["state_slots_used"] == 0 and st["kv_pages_used"] == 0, st
    assert eng.allocator.slots.num_free == eng.allocator.slots.num_slots


def test_model_chunked_prefill_and_decode_match_transformers(kimi):
    from splash.model import load_model

    path, hf, _, _ = kimi
    ids = list(range(3, 80)) + list(range(5, 70))  # 142 tokens: chunks of 50, 1, 49, 42 cross CHUNK = 64
    with torch.no_grad(), kda_core_float64():
        want = hf_logits(hf, ids)
    with torch.no_grad():
        plain = hf_logits(hf, ids)
    model = load_model(path, dtype=torch.float64)
    assert model.cfg.is_hybrid and [la.kind for la in model.layers] == ["kda", "kda", "mla", "kda"]
    runner = SimpleRunner(model, num_pages=128, page_size=4)
    s = Seq(ids=ids)
    with torch.no_grad():
        got = torch.cat([runner.all_logits(s, n) for n in (50, 1, 49, len(ids) - 100)])
        s2 = Seq(ids=ids)
        dec = torch.cat([runner.all_logits(s2, 1) for _ in ids])
    assert (got - want).abs().max() < 1e-9, (got - want).abs().max()
    assert (dec - want).abs().max() < 1e-9, (dec - want).abs().max()
    # the float32 core of the unpatched reference is ~1e-5 away: the patch is what the check rests on
    assert (plain - want).abs().max() > 1e-8


def test_engine_matches_transformers_with_chunked_prefill_and_mid_run_admission(kimi):
    path, hf, ref, plain = kimi
    assert ref == plain, "the float32 and float64 cores disagree on a greedy token of this fixture"
    eng = build_engine(model=path, num_kv_pages=256, max_num_batched_tokens=16, **ENGINE)
    try:
        assert eng.allocator.cache.snaps is not None, "hybrids run the prefix cache with state snapshots"
        for i in (0, 1, 2):
            eng.add_request(f"r{i}", prompt_token_ids=PROMPTS[i], params=greedy(logprobs=0))

        def admit(e):
            if e.steps == 5:
                for i in (3, 4):
                    e.add_request(f"r{i}", prompt_token_ids=PROMPTS[i], params=greedy(logprobs=0))

        final = drain(eng, admit)
        for i, p in enumerate(PROMPTS):
            out = final[f"r{i}"].outputs[0]
            assert out.token_ids == ref[i], f"prompt {i}"
            with torch.no_grad(), kda_core_float64():
                lp = hf_logits(hf, p + out.token_ids[:-1]).log_softmax(-1)[len(p) - 1:]
            want = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            got = torch.tensor([d[t] for d, t in zip(out.logprobs, out.token_ids)], dtype=torch.float64)
            assert (got - want).abs().max() < 1e-9, (got - want).abs().max()
        st = eng.stats()
        assert st["state_slots_total"] == 8
        idle(eng)
    finally:
        eng.shutdown()


def test_state_slots_bound_admission_and_preemption_recomputes_state(kimi):
    path, _, ref, _ = kimi
    # 2 slots for 5 requests: never more than 2 admitted; a pool of 12 pages forces preemptions too
    eng = build_engine(model=path, num_kv_pages=12, max_num_batched_tokens=16, num_state_slots=2, **ENGINE)
    try:
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", prompt_token_ids=p, params=greedy())
        seen = []
        final = drain(eng, lambda e: seen.append((e.stats()["state_slots_used"], len(e.scheduler.running))))
        assert max(u for u, _ in seen) == 2 and max(n for _, n in seen) <= 2
        assert all(u == n for u, n in seen), "a running request without its slot, or a slot leaked"
        assert eng.scheduler.num_preemptions > 0
        assert [final[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == ref
        idle(eng)
    finally:
        eng.shutdown()


def test_abort_and_weight_update_never_read_stale_state(kimi, tmp_path):
    from safetensors.torch import load_file

    path, _, ref, _ = kimi
    other = build_kimi(tmp_path / "other", seed=5)
    hf_b = kimi_reference(other)
    with kda_core_float64():
        ref_b = [hf_greedy(hf_b, p, NEW) for p in PROMPTS]
    del hf_b
    eng = build_engine(model=path, num_kv_pages=256, max_num_batched_tokens=8, **ENGINE)
    try:
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", prompt_token_ids=p, params=greedy())
        aborted = {}

        def abort(e):
            if e.steps == 3:  # mid chunked prefill of request 3 (37 tokens, 8 rows a step)
                aborted["r3"] = e.abort("r3")

        final = drain(eng, abort)
        assert aborted["r3"].outputs[0].finish_reason == "abort"
        assert all(final[f"r{i}"].outputs[0].token_ids == ref[i] for i in (0, 1, 2, 4))
        idle(eng)
        eng.update_weights_from_tensors(load_file(f"{other}/model.safetensors"))
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"b{i}", prompt_token_ids=p, params=greedy())
        final = drain(eng)
        assert [final[f"b{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == ref_b
        idle(eng)
    finally:
        eng.shutdown()


def test_builtin_tiny_hybrid_serves():
    eng = build_engine(model="tiny-hybrid", dtype="float32", num_kv_pages=64, max_num_seqs=4, device="cpu")
    try:
        for i, p in enumerate(PROMPTS[:3]):
            eng.add_request(str(i), prompt_token_ids=p, params=greedy(6))
        final = drain(eng)
        assert all(len(final[str(i)].outputs[0].token_ids) == 6 for i in range(3))
        assert eng.stats()["state_slots_total"] == 4
        idle(eng)
    finally:
        eng.shutdown()
