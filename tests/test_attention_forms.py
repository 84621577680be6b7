"""Attention forms (splash/attention/mha.py): the per-chunk cost rule, and the engine on T = 2 ranks with
prefill chunks in MHA form and decode rows absorbed, in every layout and through live switches.

A tiny float64 DeepSeek-V3 checkpoint (transformers-made) serves a long prompt next to short ones with
16-row chunks: the long prompt's first chunks take the MHA form and its later chunks (context past the
rule's crossover) and every decode row the absorbed form, so one request crosses from one form to the
other. Checked per layout and across a forced switch schedule: greedy tokens equal transformers', and
every sampled row's logits equal the single-rank engine's run entirely in the absorbed form to 1e-9.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference

from splash.attention import mha
from splash.config import EngineConfig
from splash.core.forms import chunk_costs
from splash.engine.build import build_engine
from splash.engine.group import RankGroup
from splash.engine.sampling import SamplingParams

V3 = SimpleNamespace(d_c=512, d_rope=64, d_nope=128, d_v=128)  # DeepSeek-V3 / Kimi-K2 MLA dims


def test_cost_rule_picks_mha_for_prefill_and_absorbed_for_decode():
    for n in (2, 16, 128, 512, 2048, 8192):  # first chunks: n rows over their own n keys
        assert mha.prefers_mha(n, n, V3), n
    for ctx in (2, 64, 512, 4096, 131072):  # a decode row over its context
        assert not mha.prefers_mha(1, ctx, V3), ctx
    assert not mha.prefers_mha(16, 4096, V3)  # a short chunk late in a long prompt
    assert mha.prefers_mha(512, 4096, V3)  # a full chunk there: 512 rows pay for decompressing 4096 keys
    # One crossover in rows for a given context, and the formula's terms as written in the issue.
    flips = [mha.prefers_mha(r, 4096, V3) for r in range(1, 1024)]
    assert flips == sorted(flips) and flips[0] is False and flips[-1] is True
    a, m = chunk_costs(3, 10, 2, 512, 64, 128, 128)
    assert a == 3 * 10 * 2 * (512 + 64 + 512) + 3 * 2 * 2 * 128 * 512
    assert m == 10 * 2 * (128 + 128) * 512 + 3 * 10 * 2 * (128 + 64 + 128)
    assert not mha.prefers_mha(512, 512, V3, form="absorbed")
    assert mha.prefers_mha(1, 4096, V3, form="mha")
    with pytest.raises(ValueError, match="attention form"):
        EngineConfig(attention_form="latent")


def test_blocked_attention_equals_one_block_with_blind_rows_and_lse():
    """`attend_blocked` in blocks of 2 query rows (CPU) equals one block (other devices) and a direct
    softmax in float64, incl. the log-sum-exp CP merges with, and rows that see no key (CP: a rank
    without their pages) get 0 and lse -inf."""
    from test_layouts_dist import full_mla

    mla = full_mla()
    g = torch.Generator().manual_seed(4)
    n, m = 5, 9
    q_nope = torch.randn(n, mla.num_heads, mla.d_nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(n, mla.num_heads, mla.d_rope, generator=g, dtype=torch.float64)
    latent = torch.randn(m, mla.d_c + mla.d_rope, generator=g, dtype=torch.float64)
    key_pos = torch.tensor([3, 4, 5, 6, 7, 12, 13, 14, 15])  # a rank's share of the positions
    q_pos = torch.tensor([1, 2, 5, 13, 20])  # rows 0 and 1 see no key here
    k, v = mha.decompress(mla, latent)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    out, lse = mha.attend_blocked(q, k, v, q_pos, key_pos, 0.3, True, 2)
    out1, lse1 = mha.attend_blocked(q, k, v, q_pos, key_pos, 0.3, True, n)
    s = (q @ k.transpose(1, 2) * 0.3).masked_fill((key_pos[None, :] > q_pos[:, None])[None], float("-inf"))
    ref, ref_lse = (torch.softmax(s[:, 2:], -1) @ v).transpose(0, 1), torch.logsumexp(s[:, 2:], -1).t()
    for o, t in ((out, lse), (out1, lse1)):
        assert torch.allclose(o[2:], ref, atol=1e-13) and torch.allclose(t[2:], ref_lse, atol=1e-13)
        assert torch.equal(o[:2], torch.zeros_like(o[:2]))
        assert torch.equal(t[:2], torch.full_like(t[:2], float("-inf")))


@pytest.mark.parametrize("group_keys", [8192, 10])
def test_chunks_decompressed_together_equal_each_alone(monkeypatch, group_keys):
    """`attend_many` (one GEMM over several chunks' contexts, with W_UK and W_UV side by side) equals a
    direct float64 reference per chunk from the head-major weights; a chunk with no context gets 0 and
    lse -inf, and a small group bound (several GEMMs) changes nothing."""
    from test_layouts_dist import full_mla

    monkeypatch.setattr(mha, "_GROUP_KEYS", group_keys)
    mla = full_mla()
    g = torch.Generator().manual_seed(5)
    h, dn, dr = mla.num_heads, mla.d_nope, mla.d_rope
    chunks = []
    for n, m in ((4, 7), (3, 0), (6, 6), (2, 9)):
        chunks.append(mha.Chunk(torch.randn(n, h, dn, generator=g, dtype=torch.float64),
                                torch.randn(n, h, dr, generator=g, dtype=torch.float64),
                                torch.randn(m, mla.d_c + dr, generator=g, dtype=torch.float64),
                                torch.arange(m), torch.arange(m - n, m) if m else torch.arange(n)))
    got = mha.attend_many(mla, chunks, 0.25, lse=True)
    for c, (o, t) in zip(chunks, got):
        n = c.q_nope.shape[0]
        if c.latent.shape[0] == 0:
            assert torch.equal(o, torch.zeros(n, h, mla.d_v, dtype=torch.float64))
            assert torch.equal(t, torch.full((n, h), float("-inf"), dtype=torch.float64))
            continue
        lat, k_pe = c.latent[:, :mla.d_c], c.latent[:, mla.d_c:]
        k_nope = torch.einsum("mc,hdc->hmd", lat, mla.w_uk)
        v = torch.einsum("mc,hcd->hmd", lat, mla.w_uv)
        s = torch.einsum("nhd,hmd->hnm", c.q_nope, k_nope) + torch.einsum("nhd,md->hnm", c.q_pe, k_pe)
        s = s * 0.25
        s = s.masked_fill((c.key_pos[None, :] > c.q_pos[:, None])[None], float("-inf"))
        ref = torch.einsum("hnm,hmd->nhd", torch.softmax(s, -1), v)
        assert torch.allclose(o, ref, atol=1e-12)
        assert torch.allclose(t, torch.logsumexp(s, -1).t(), atol=1e-12)


# ---- the engine on two ranks -------------------------------------------------------------------------
NEW = 5
P = 4
LONG = [(7 * i) % 90 + 3 for i in range(100)]
PROMPTS = [LONG, [5, 6, 7], list(range(10, 31)), [90, 1, 33, 4, 8, 61]]
ENGINE = dict(dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=16, device="cpu",
              num_kv_pages=128)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def run(eng, prompts):
    """Greedy tokens, {(prompt, position): logits row}, and per prompt the forms its slices took
    ("mha"/"absorbed" per chunk, decode rows included) by the rule the layouts apply."""
    logits: dict[tuple[int, int], torch.Tensor] = {}
    forms: dict[int, list[tuple[int, str]]] = {}
    dims = SimpleNamespace(d_c=24, d_rope=32, d_nope=12, d_v=10)  # helpers_ckpt.BASE

    def hook(plan, seqs, rows):
        for seq, sl in zip(seqs, plan.seqs):
            use = sl.num_new > 1 and mha.prefers_mha(sl.num_new, sl.end, dims)
            forms.setdefault(int(seq.group.request_id), []).append((sl.num_new, "mha" if use else "absorbed"))
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
            logits[(int(seq.group.request_id), len(seq.output_token_ids))] = row.clone()

    eng.logits_hook = hook
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=greedy())
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
    eng.logits_hook = None
    assert eng.stats()["kv_pages_used"] == 0
    return [done[i] for i in range(len(prompts))], logits, forms


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Checkpoint, transformers' greedy tokens, the single-rank engine's logits in the absorbed form."""
    path = build_checkpoint(tmp_path_factory.mktemp("forms") / "v3", "v3", seed=2)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    eng = build_engine(model=path, attention_form="absorbed", **ENGINE)
    try:
        toks, logits, _ = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert toks == ref, "the single-rank engine (absorbed) disagrees with transformers"
    return path, ref, logits


def close(logits, ref_logits, name: str) -> None:
    assert logits.keys() == ref_logits.keys(), f"{name}: sampled rows differ"
    err = max((logits[k] - ref_logits[k]).abs().max().item() for k in logits)
    assert err < 1e-9, f"{name}: logits differ from the absorbed single-rank engine by {err:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("one_torch_thread")
def test_prefill_in_mha_form_matches_in_every_layout_and_through_switches(ckpt):
    path, ref, ref_logits = ckpt
    eng = build_engine(model=path, attention_form="auto", **ENGINE)  # T = 1 (the local layout)
    try:
        toks, logits, forms = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert toks == ref
    close(logits, ref_logits, "T=1 auto")
    long = forms[0]
    assert long[0] == (16, "mha"), long  # the long prompt starts in MHA form ...
    assert any(n > 1 and f == "absorbed" for n, f in long), long  # ... later chunks absorbed ...
    assert all(f == "absorbed" for n, f in long if n == 1) and long[-1][0] == 1  # ... and its decodes
    g = RankGroup.start(2, device="cpu", timeout_s=60.0, threads=1)
    try:
        for layout, schedule in (("tp", None), ("dp", None), ("cp", None), ("dop", None),
                                 ("tp", "2:dop,4:cp,6:dp,9:tp,12:dop")):
            eng = build_engine(model=path, layout=layout, rank_group=g, attention_form="auto",
                               switch_schedule=schedule, **ENGINE)
            try:
                toks, logits, forms = run(eng, PROMPTS)
                switches = eng.stats()["num_switches"]
            finally:
                eng.shutdown()
            name = f"T=2 {layout}" + (f" switching {schedule}" if schedule else "")
            assert toks == ref, f"{name}: tokens differ from transformers"
            close(logits, ref_logits, name)
            assert forms[0][0] == (16, "mha"), f"{name}: {forms[0]}"
            if schedule:
                assert switches == 5, f"{name}: {switches} switches"
    finally:
        g.close()
