"""The built-in benchmark model `small` (`splash model init-small`, `--model small`): DeepSeek-V3's real
MLA per-head dims, a config.json vLLM can load, and the same forward as transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers_ckpt import Seq, SimpleRunner, hf_reference

from splash.cli import main
from splash.core.model_config import ModelConfig
from splash.core.presets import PRESETS

torch.set_num_threads(1)
SMALL = PRESETS["small"]


def test_small_has_deepseek_v3_mla_dims_and_a_config_vllm_loads():
    from splash.model.tiny import hf_config_dict, weight_shapes

    assert (SMALL.kv_lora_rank, SMALL.qk_rope_head_dim, SMALL.qk_nope_head_dim, SMALL.v_head_dim) == (
        PRESETS["deepseek-v3"].kv_lora_rank, 64, 128, 128)
    assert SMALL.latent_dim == 576  # vLLM's CPU MLA decode kernel takes head dim 576 only
    assert SMALL.q_lora_rank and SMALL.hidden_size == 512 and SMALL.num_hidden_layers == 4
    assert SMALL.n_routed_experts == 8 and SMALL.first_k_dense_replace == 1
    d = hf_config_dict(SMALL)
    assert d["topk_method"] == "noaux_tc" and d["scoring_func"] == "sigmoid"  # else vLLM cannot load the bias
    assert d["architectures"] == ["DeepseekV3ForCausalLM"]
    assert ModelConfig.from_dict(d, name="small") == SMALL
    shapes = weight_shapes(SMALL)
    assert shapes["model.layers.1.self_attn.kv_b_proj.weight"] == (16 * (128 + 128), 512)
    assert shapes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 512)
    assert "model.layers.0.mlp.gate.weight" not in shapes  # first_k_dense_replace = 1
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in shapes
    assert SMALL.vocab_size == PRESETS["tiny"].vocab_size  # it ships tiny's tokenizer


@pytest.fixture(scope="module")
def small2_dir(tmp_path_factory):
    """`splash model init-small` with the preset cut to 2 layers (one dense, one MoE) to keep it cheap."""
    mp = pytest.MonkeyPatch()
    mp.setitem(PRESETS, "small", SMALL.replace(num_hidden_layers=2))
    try:
        d = str(tmp_path_factory.mktemp("small") / "ckpt")
        assert main(["model", "init-small", d]) == 0
    finally:
        mp.undo()
    return d


def test_init_small_writes_a_loadable_checkpoint(small2_dir, capsys):
    cfg = ModelConfig.from_hf(small2_dir)
    assert cfg.replace(name="small") == SMALL.replace(num_hidden_layers=2)
    with open(os.path.join(small2_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["topk_method"] == "noaux_tc" and raw["scoring_func"] == "sigmoid"
    assert os.path.isfile(os.path.join(small2_dir, "tokenizer.json"))
    assert main(["model", "init-small", small2_dir]) == 2  # refuses to overwrite without --force
    assert "--force" in capsys.readouterr().err


def test_small_matches_transformers_in_float64(small2_dir):
    """Full-prompt logits and a few greedy tokens against transformers' DeepseekV3 in float64.

    The prompt has 16+ tokens: both routers run in float32, and on AVX-512 MKL's float32 GEMM sums in
    another order below 16 rows, so transformers' own logits of a shorter prompt differ ~1e-6 from its
    own decode steps; splash pads router GEMMs to 16 rows (model/moe.py) to be shape-independent."""
    from splash.model import load_model

    ids = [256, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102]
    hf = hf_reference(small2_dir)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    model = load_model(small2_dir, "float64")
    got = SimpleRunner(model, page_size=16).all_logits(Seq(list(ids)), len(ids))
    err = (got - want).abs().max().item()
    assert err < 1e-9, err
    runner, seq = SimpleRunner(model, page_size=16), Seq(list(ids))
    work = len(ids)
    for _ in range(4):
        seq.ids.append(int(runner.step([(seq, work)])[0].argmax()))
        work = 1
    assert seq.ids[len(ids):] == greedy


def test_model_small_resolves_to_the_cached_builtin(tmp_path, monkeypatch):
    from splash.model import resolve_model_path, tiny

    monkeypatch.setenv("SPLASH_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(tiny, "write_builtin_model", lambda p, name, seed=0: (calls.append(name), open(
        os.path.join(p, "model.safetensors"), "w").close()))
    path = resolve_model_path("small")
    assert os.path.basename(path).startswith("small-v") and calls == ["small"]
    assert resolve_model_path("small") == path and calls == ["small"]  # cached: not written again
    with pytest.raises(ValueError, match="built-in model"):
        resolve_model_path(str(tmp_path / "nothing"))
