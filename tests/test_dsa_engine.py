"""DSA models (DeepSeek-V3.2, GLM-5 with shared indexer layers) through the ENGINE on T = 1, 2 and 4.

Tiny float64 transformers checkpoints with index_topk 8 well below the prompts (attention is really
sparse), chunked prefill of 8 rows a step. Checked: the single-rank engine's greedy tokens equal
transformers' (also through preemption by recompute); every fixed layout at T = 2 and T = 4 gives those
tokens and the single-rank engine's logits to 1e-9; all 12 switch directions in consecutive steps from
step 1 (mid chunked prefill), overlapped and blocking, move the indexer's keys with the latent (tokens,
logits, page accounting; the executor's bytes are the manifest's, the indexer's included); an abort mid
run, preemption and a weight update that changes the indexer's weights, under a live switch, change no
answer and leak no page.
"""

from __future__ import annotations

import pytest
import torch
from helpers_dsa import build_dsa_checkpoint, hf_dsa_reference, hf_greedy
from test_engine_switch import close, greedy, run, serve_aborting

from splash.engine.build import build_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

NEW = 6
P = 4
PROMPTS = [list(range(10, 31)), [5, 6, 7], list(range(3, 20)), [90, 1, 33, 4, 8, 61, 9, 9, 13, 60, 12, 50],
           list(range(40, 54))]
ENGINE = dict(dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=8, device="cpu")
CIRCUIT = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
ALL12 = "".join(f"{i + 1}:{lay}," for i, lay in enumerate(CIRCUIT[1:])).rstrip(",")


@pytest.fixture(scope="module", params=["v32", "glm"])
def ckpt(request, tmp_path_factory):
    """A DSA checkpoint, transformers' greedy tokens, and the single-rank engine's sampled logits."""
    path = build_dsa_checkpoint(tmp_path_factory.mktemp(f"dsa-{request.param}"), request.param, seed=3,
                                index_head_dim=48)
    hf = hf_dsa_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    eng = build_engine(model=path, num_kv_pages=64, **ENGINE)
    try:
        toks, logits, errors = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert toks == ref, "the single-rank engine disagrees with transformers"
    return path, ref, logits


def test_one_rank_preemption_matches_transformers(ckpt):
    path, ref, _ = ckpt
    eng = build_engine(model=path, num_kv_pages=12, **ENGINE)  # 48 tokens for 5 requests of 9-27
    try:
        toks, _, errors = run(eng, PROMPTS)
        assert eng.scheduler.num_preemptions > 0
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert toks == ref


def test_every_layout(group, ckpt):
    path, ref, ref_logits = ckpt
    for layout in ("tp", "dp", "cp", "dop"):
        eng = build_engine(model=path, layout=layout, rank_group=group, num_kv_pages=64, **ENGINE)
        try:
            toks, logits, errors = run(eng, PROMPTS)
        finally:
            eng.shutdown()
        name = f"T={group.world} {layout}"
        assert not errors, f"{name}: {errors[:5]}"
        assert toks == ref, f"{name}: tokens differ from transformers"
        close(logits, ref_logits, name)


def test_all_12_directions_move_the_indexer_keys(group, ckpt):
    path, ref, ref_logits = ckpt
    results = {}
    for mode in ("overlapped", "blocking"):
        eng = build_engine(model=path, layout="tp", rank_group=group, num_kv_pages=96, switch_schedule=ALL12,
                           switch_mode=mode, **ENGINE)
        try:
            toks, logits, errors = run(eng, PROMPTS)
            st = eng.stats()
            events = [e for e in eng.switcher.events if e.refused is None]
        finally:
            eng.shutdown()
        name = f"T={group.world} {mode}"
        assert not errors, f"{name}: {errors[:5]}"
        assert toks == ref, f"{name}: tokens differ from transformers"
        close(logits, ref_logits, name)
        assert {(e.src, e.dst) for e in events} == set(zip(CIRCUIT, CIRCUIT[1:])), name
        assert st["num_switches"] == 12 and st["switch_refusals"] == 0
        results[mode] = logits
    for k in results["overlapped"]:
        assert torch.equal(results["overlapped"][k], results["blocking"][k]), f"modes differ at {k}"


def test_abort_preemption_and_indexer_weight_update_under_switches(group, ckpt, tmp_path):
    """DOP in a pool that preempts, switching to CP, DP and back, one request aborted mid-run; then the
    weights of another checkpoint (every tensor, the indexer's too) pushed as tensors, and the same
    prompts must give that checkpoint's tokens; no page is left in use."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    from safetensors.torch import load_file

    path, ref, _ = ckpt
    kind = "glm" if "glm" in str(path) else "v32"
    other = build_dsa_checkpoint(tmp_path / "b", kind, seed=11, index_head_dim=48)
    hf = hf_dsa_reference(other)
    ref_b = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    eng = build_engine(model=path, layout="dop", rank_group=group, num_kv_pages=7,
                       switch_schedule="3:cp,6:dp,9:dop", **ENGINE)
    try:
        done, errors = serve_aborting(eng, PROMPTS, greedy())
        st = eng.stats()
        # (the tight pool refuses some of the switches: at least one must happen)
        assert eng.scheduler.num_preemptions > 0 and st["num_switches"] >= 1, st
        assert done[1].finish_reason == "abort"
        assert all(done[i].token_ids == ref[i] for i in (0, 2, 3, 4))
        assert not errors, errors[:5]
        eng.update_weights_from_tensors(load_file(f"{other}/model.safetensors"))
        toks, _, errors = run(eng, PROMPTS)
        assert toks == ref_b, "after the update: tokens differ from the new checkpoint's"
        assert not errors, errors[:5]
        assert sum(eng.stats()["kv_pages_used_per_rank"]) == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_switch_schedules(group, ckpt, seed):
    """Seeded random schedules: a switch at a random step (mid chunked prefill or in decode) to a random
    other layout, several in a row; tokens and logits unchanged."""
    import random

    path, ref, ref_logits = ckpt
    rng = random.Random(seed * 10 + group.world)
    layouts, cur, steps = ["tp", "dp", "cp", "dop"], rng.choice(["tp", "dp", "cp", "dop"]), []
    start = cur
    for step in sorted(rng.sample(range(1, 14), 6)):
        cur = rng.choice([x for x in layouts if x != cur])
        steps.append(f"{step}:{cur}")
    eng = build_engine(model=path, layout=start, rank_group=group, num_kv_pages=96,
                       switch_schedule=",".join(steps), switch_mode=rng.choice(["overlapped", "blocking"]),
                       **ENGINE)
    try:
        toks, logits, errors = run(eng, PROMPTS)
        st = eng.stats()
    finally:
        eng.shutdown()
    name = f"T={group.world} {start} then {','.join(steps)}"
    assert not errors, f"{name}: {errors[:5]}"
    assert toks == ref, f"{name}: tokens differ"
    close(logits, ref_logits, name)
    assert st["num_switches"] >= 4 and st["switch_refusals"] == 0, (name, st["num_switches"])
