"""Speculative decoding with the checkpoint's MTP layer (splash/engine/mtp.py, splash/model/mtp.py), float64.

The drafts are the MTP layer's: every chain the engine proposed equals an independent reference built
from transformers' own decoder layer (the MTP block, teacher-forced over the target's final hidden
states, then chained on its own outputs), so the draft KV (the `mtp_latent` store) is right wherever it
lives. The tokens are the target's: greedy output equals transformers' and the engine's without
speculation, logprobs to 1e-9, with chunked prefill, preemption, abort and the prefix cache, the books
proved after every step; at T = 2 the same through all 12 switch directions (the MTP layer's weights and
KV move with the others) with the same drafts as T = 1; one T = 4 run; DSA models (the MTP layer's own
indexer); a weight update reaches the MTP layer.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers_ckpt import add_mtp_layer, build_checkpoint, hf_greedy, hf_reference, serve_requests

from splash.core.model_config import ConfigError
from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [3, 4, 3, 4, 3, 4, 3, 4, 3], list(range(10, 31)),
           [90, 1, 33, 4, 8, 61]]
NEW = 16
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=12, device="cpu",
              speculative_algorithm="MTP", speculative_policy="always")
CIRCUIT = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
ALL12 = ",".join(f"{i + 2}:{lay}" for i, lay in enumerate(CIRCUIT[1:]))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A V3 checkpoint with one MTP layer, transformers' model and greedy tokens."""
    path = add_mtp_layer(build_checkpoint(tmp_path_factory.mktemp("mtp") / "v3", "v3", seed=5), seed=1)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, hf, ref


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)


def serve(eng, prompts, params, abort=None) -> tuple[dict, list]:
    """({prompt index: final output}, [(request, context, tokens so far, drafts)] of every chain)."""
    chains: list = []
    drafter = eng.mtp
    inner = drafter.after_step

    def record(st):
        inner(st)
        for seq in st.seqs:
            d = drafter.drafts.get(seq)
            if d:
                chains.append((int(seq.group.request_id), seq.num_computed,
                               seq.token_slice(0, seq.num_tokens), list(d)))

    drafter.after_step = record
    return serve_requests(eng, prompts, params, abort), chains


class ReferenceMTP:
    """The MTP layer from transformers' parts: its decoder block is a DeepseekV3DecoderLayer with the
    checkpoint's layer-L tensors; x = eh_proj([enorm(embed(next)); hnorm(h)]), head(norm(block(x)))."""

    def __init__(self, hf, path: str) -> None:
        from safetensors.torch import load_file

        cfg = hf.config
        self.hf, self.L = hf, cfg.num_hidden_layers
        w = load_file(os.path.join(path, "model.safetensors"))
        pre = f"model.layers.{self.L}."
        mine = {k[len(pre):]: v for k, v in w.items() if k.startswith(pre)}
        e = cfg.n_routed_experts  # per-expert tensors (the hub's form) -> transformers' stacked ones
        if "mlp.experts.0.gate_proj.weight" in mine:
            ex = [{p: mine.pop(f"mlp.experts.{j}.{p}_proj.weight") for p in ("gate", "up", "down")}
                  for j in range(e)]
            mine["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in ex])
            mine["mlp.experts.down_proj"] = torch.stack([x["down"] for x in ex])
        self.block = type(hf.model.layers[0])(cfg, layer_idx=self.L).to(torch.float64).eval()
        missing, _ = self.block.load_state_dict(mine, strict=False)
        assert not missing, missing
        self.w = mine

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        v = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(v + self.hf.config.rms_norm_eps))

    @torch.no_grad()
    def chain(self, tokens: list[int], q: int, k: int) -> list[int]:
        """The k drafts after context q (tokens[q] the newest): teacher-forced rows 0..q-1, then k - 1
        chained rows at positions q .. q + k - 2 whose hidden is the previous row's normed output."""
        hf = self.hf
        hidden = hf.model(torch.tensor([tokens[:q]])).last_hidden_state[0]  # after the final norm
        emb = hf.model.embed_tokens
        nxt = list(tokens[1:q + 1])
        hs = [hidden[i] for i in range(q)]
        drafts: list[int] = []
        for _ in range(k):
            e = emb(torch.tensor(nxt))
            h = torch.stack(hs)
            x = torch.cat([self.norm(e, "enorm.weight"), self.norm(h, "hnorm.weight")], -1) @ self.w[
                "eh_proj.weight"].T
            pos = torch.arange(len(nxt))[None]
            rot = hf.model.rotary_emb(x[None], pos)
            out = self.block(x[None], position_embeddings=rot, position_ids=pos)[0]
            hn = self.norm(out[-1], "shared_head.norm.weight")
            d = int((hn @ self.w["shared_head.head.weight"].T).argmax())
            drafts.append(d)
            nxt.append(d)
            hs.append(hn)
        return drafts


def check_chains(ref_mtp: ReferenceMTP, chains: list) -> int:
    for rid, q, toks, drafts in chains:
        assert ref_mtp.chain(toks, q, len(drafts)) == drafts, (rid, q)
    return len(chains)


def test_drafts_are_the_mtp_layers_and_tokens_the_targets(ckpt):
    path, hf, ref = ckpt
    plain_eng = build_engine(model=path, num_kv_pages=96, **{**ENGINE, "speculative_algorithm": None})
    try:
        for i, p in enumerate(PROMPTS):
            plain_eng.add_request(str(i), prompt_token_ids=p, params=greedy())
        plain = {}
        while plain_eng.has_unfinished():
            plain.update({int(o.request_id): o.outputs[0] for o in plain_eng.step() if o.finished})
    finally:
        plain_eng.shutdown()
    eng = build_engine(model=path, num_kv_pages=96, speculative_num_steps=3, **ENGINE)
    try:
        got, chains = serve(eng, PROMPTS, greedy())
        info = eng.stats()
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == ref
    for i in got:
        for a, b in zip(got[i].logprobs, plain[i].logprobs):
            assert max(abs(a[t] - b[t]) for t in a.keys() & b.keys()) < 1e-9
    assert info["spec_verify_ct"] > 0 and info["speculative_algorithm"] == "MTP"
    assert any(len(c[3]) == 3 for c in chains)
    assert check_chains(ReferenceMTP(hf, path), chains[:12]) == 12


def drafting_every(eng, every: int) -> list[int]:
    """Let requests draft only after every `every`-th step: the steps between have no draft phase, so the
    ranks write their rows' draft KV at the start of the next step (ModelRunner.extend_lagged). -> the
    steps after which a draft phase ran (filled while serving)."""
    d, ran, at = eng.mtp, [], [0]
    can, after, call = d.can_speculate, d.after_step, d.runner.draft

    def after_step(st):
        at[0] = st.plan.step
        after(st)

    def draft(plan):
        ran.append(at[0])
        return call(plan)

    d.can_speculate = lambda seq: can(seq) if at[0] % every == 0 else 0
    d.after_step, d.runner.draft = after_step, draft
    return ran


def test_draft_kv_written_a_step_late_where_no_draft_phase_ran(ckpt):
    """Steps with no request drafting next run no draft phase: the rows they made final get their draft
    KV at the start of the next step instead. Chains after such steps read those rows, so they equal the
    teacher-forced reference only if every lagged row was written, at the right place, with the right
    token (a decode row, a verify's accepted rows, a prefill chunk)."""
    path, hf, ref = ckpt
    eng = build_engine(model=path, num_kv_pages=96, speculative_num_steps=2, **ENGINE)
    try:
        ran = drafting_every(eng, 3)
        got, chains = serve(eng, PROMPTS, greedy())
        steps = eng.stats()["steps"]
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == ref
    assert ran and len(ran) < steps / 2  # (most steps ran no draft phase)
    assert check_chains(ReferenceMTP(hf, path), chains[:10]) == 10


def test_mtp_through_preemption_abort_and_prefix_cache(ckpt):
    path, hf, ref = ckpt
    prompts = PROMPTS + [PROMPTS[0] + [40, 41], PROMPTS[2][:14]]
    eng = build_engine(model=path, num_kv_pages=18, speculative_num_steps=2, **ENGINE)
    try:
        got, chains = serve(eng, prompts, greedy(), abort=(6, 1))
        stats, preempted = eng.stats(), eng.scheduler.num_preemptions
    finally:
        eng.shutdown()
    assert preempted > 0 and stats["kv_pages_used"] == 0
    for i in range(len(PROMPTS)):
        if i == 1:
            assert got[1].finish_reason == "abort" and got[1].token_ids == ref[1][:len(got[1].token_ids)]
        else:
            assert got[i].token_ids == ref[i], i
    # (chains after a cache hit read draft KV another request wrote: the reference still holds)
    check_chains(ReferenceMTP(hf, path), [c for c in chains if c[0] >= len(PROMPTS)][:6])


@pytest.mark.slow
def test_mtp_switches_in_all_12_directions(group, ckpt):
    """T = 2, a switch between speculative steps in every direction: the MTP layer's heads and draft KV
    move with the rest, so the chains are T = 1's and the tokens transformers'."""
    if group.world != 2:
        pytest.skip("T = 2 only (T = 4: test_mtp_at_four_ranks)")
    path, hf, ref = ckpt
    sampled = SamplingParams(temperature=0.8, top_k=30, max_tokens=NEW, ignore_eos=True, seed=11)
    one = build_engine(model=path, num_kv_pages=96, speculative_num_steps=2, **ENGINE)
    try:
        _, one_chains = serve(one, PROMPTS, greedy())
        one_sampled, _ = serve(one, PROMPTS, sampled)
    finally:
        one.shutdown()
    eng = build_engine(model=path, num_kv_pages=96, layout="tp", rank_group=group, switch_schedule=ALL12,
                       speculative_num_steps=2, **ENGINE)
    try:
        got, chains = serve(eng, PROMPTS, greedy())
        stats = eng.stats()
        two_sampled, _ = serve(eng, PROMPTS, sampled)  # (rejection sampling over the same drafts)
    finally:
        eng.shutdown()
    assert stats["num_switches"] == 12
    assert [o.token_ids for o in got.values()] == ref
    assert chains == one_chains
    assert [o.token_ids for o in two_sampled.values()] == [o.token_ids for o in one_sampled.values()]


def test_lagged_draft_kv_through_switches(group, ckpt):
    """T = 2, drafting after every third step only, switches landing on steps whose last step ran no draft
    phase (the lagged rows are written under the old layout, then move with the rest): the chains are
    T = 1's under the same drafting, the tokens transformers'."""
    if group.world != 2:
        pytest.skip("T = 2 only")
    path, hf, ref = ckpt
    one = build_engine(model=path, num_kv_pages=96, speculative_num_steps=2, **ENGINE)
    try:
        drafting_every(one, 3)
        _, one_chains = serve(one, PROMPTS, greedy())
    finally:
        one.shutdown()
    eng = build_engine(model=path, num_kv_pages=96, layout="tp", rank_group=group, speculative_num_steps=2,
                       switch_schedule="2:dp,5:dop,8:cp,11:tp,14:cp,17:dp", **ENGINE)
    try:
        drafting_every(eng, 3)
        got, chains = serve(eng, PROMPTS, greedy())
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert stats["num_switches"] == 6
    assert [o.token_ids for o in got.values()] == ref
    assert chains == one_chains


def test_mtp_at_four_ranks(group, ckpt):
    """T = 4 from DOP into CP mid-run (owners, all-to-all rows, positions striped over ranks)."""
    if group.world != 4:
        pytest.skip("T = 4 only")
    path, hf, ref = ckpt
    eng = build_engine(model=path, num_kv_pages=96, layout="dop", rank_group=group, switch_schedule="5:cp",
                       speculative_num_steps=2, **ENGINE)
    try:
        got, chains = serve(eng, PROMPTS[:3], greedy())
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert stats["num_switches"] == 1 and chains
    assert [o.token_ids for o in got.values()] == ref[:3]
    check_chains(ReferenceMTP(hf, path), chains[-3:])


@pytest.mark.parametrize("model", ["tiny-dsa", "tiny-glm5"])
def test_mtp_on_sparse_attention_models(tmp_path, model):
    """DeepSeek-V3.2 / GLM-5 shapes with an MTP layer (its own indexer and `mtp_index_k` store): the
    tokens equal the engine's without speculation."""
    from splash.core.presets import PRESETS
    from splash.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / model, seed=3,
                            cfg=dataclasses.replace(PRESETS[model], num_nextn_predict_layers=1))
    prompts = [list(range(3, 60)), [5, 6, 7, 8, 9] * 8]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = []
    for algo in (None, "MTP"):
        eng = build_engine(model=path, num_kv_pages=256, **{**ENGINE, "max_num_batched_tokens": 16,
                                                            "speculative_algorithm": algo})
        try:
            if algo:
                assert "mtp_index_k" in eng.info["kv_bytes_per_token"]
                outs.append(serve(eng, prompts, params)[0])
                assert eng.spec_verify_ct > 0
            else:
                for i, p in enumerate(prompts):
                    eng.add_request(str(i), prompt_token_ids=p, params=params)
                done = {}
                while eng.has_unfinished():
                    done.update({int(o.request_id): o.outputs[0] for o in eng.step() if o.finished})
                outs.append(dict(sorted(done.items())))
        finally:
            eng.shutdown()
    assert [o.token_ids for o in outs[0].values()] == [o.token_ids for o in outs[1].values()]


def test_weight_update_reaches_the_mtp_layer(tmp_path, ckpt):
    """/update_weights_from_disk to a checkpoint whose MTP layer differs: the chains after it are the
    new layer's (the reference over the new weights)."""
    import shutil

    path, hf, ref = ckpt
    other = str(tmp_path / "other")
    shutil.copytree(path, other)
    add_mtp_layer(other, seed=9, noise=1.0)  # (re-adds layer L: new noise, same main weights)
    eng = build_engine(model=path, num_kv_pages=96, speculative_num_steps=2, **ENGINE)
    try:
        eng.update_weights_from_disk(other)
        got, chains = serve(eng, PROMPTS[:2], greedy())
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == ref[:2]
    check_chains(ReferenceMTP(hf, other), chains[:4])


def test_mtp_needs_mtp_layers(tmp_path):
    path = build_checkpoint(tmp_path / "plain", "v3", seed=2)
    with pytest.raises(ConfigError, match="no MTP layer"):
        build_engine(model=path, **{**ENGINE, "speculative_algorithm": "EAGLE"})


def test_mtp_with_layout_auto(group, ckpt):
    """`--layout auto` and the depth policy together at T = 2 (the policy chooses layouts on batches that
    carry verify rows): tokens are transformers'."""
    if group.world != 2:
        pytest.skip("T = 2 only")
    path, hf, ref = ckpt
    eng = build_engine(model=path, num_kv_pages=96, layout="auto", rank_group=group, speculative_num_steps=2,
                       **{**ENGINE, "speculative_policy": "auto"})
    try:
        got, _ = serve(eng, PROMPTS, greedy())
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got.values()] == ref
    assert stats["speculative_policy"] == "auto" and stats["spec_verify_ct"] > 0
