"""The DSA fixtures: the built-in tiny-dsa / tiny-glm5 checkpoints are what transformers builds (same keys,
same dense/MoE and indexer pattern), and helpers_dsa's top-k capture and score recomputation agree with the
reference."""

from __future__ import annotations

import pytest
import torch
from helpers_dsa import boundary_gaps, build_dsa_checkpoint, hf_dsa_reference, hf_topk, reference_scores

from splash.core.model_config import ModelConfig
from splash.core.presets import PRESETS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["tiny-dsa", "tiny-glm5"])
def test_builtin_dsa_checkpoint_loads_in_transformers(name, tmp_path, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from splash.model.tiny import ensure_builtin_model, weight_shapes

    monkeypatch.setenv("SPLASH_CACHE", str(tmp_path))
    cfg = PRESETS[name]
    path = ensure_builtin_model(name)
    assert ModelConfig.from_hf(path).replace(name=name) == cfg
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert set(f.keys()) == set(weight_shapes(cfg))
        assert f.get_tensor("model.layers.0.self_attn.indexer.k_norm.weight").eq(1).all()
    m, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager",
                                                   attn_implementation="sdpa", output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    arch = "GlmMoeDsaForCausalLM" if cfg.model_type == "glm_moe_dsa" else "DeepseekV32ForCausalLM"
    assert type(m).__name__ == arch
    assert m.config.index_topk == cfg.index_topk and m.config.index_n_heads == cfg.index_n_heads
    layers = m.model.layers
    assert [type(x.mlp).__name__.endswith("MoE") for x in layers] == [
        cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    assert [x.self_attn.indexer is not None for x in layers] == [
        cfg.indexer_type(i) == "full" for i in range(cfg.num_hidden_layers)]
    with torch.no_grad():
        logits = m(torch.arange(3, 3 + 24)[None]).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.3


def test_small_dsa_shapes():
    from splash.model.tiny import hf_config_dict, weight_shapes

    cfg = PRESETS["small-dsa"]
    d = hf_config_dict(cfg)
    assert d["architectures"] == ["DeepseekV32ForCausalLM"] and d["index_topk"] == 2048
    assert ModelConfig.from_dict(d, name="small-dsa") == cfg
    s = weight_shapes(cfg)
    x = "model.layers.3.self_attn.indexer"
    assert s[f"{x}.wq_b.weight"] == (8 * 128, 256) and s[f"{x}.wk.weight"] == (128, 512)
    assert s[f"{x}.weights_proj.weight"] == (8, 512) and s[f"{x}.k_norm.bias"] == (128,)
    g = hf_config_dict(PRESETS["tiny-glm5"])
    assert g["indexer_types"] == ["full", "shared", "full", "shared"]
    assert "model.layers.1.self_attn.indexer.wk.weight" not in weight_shapes(PRESETS["tiny-glm5"])


@pytest.mark.parametrize("kind", ["v32", "glm"])
def test_hf_topk_sets_and_scores(kind, tmp_path):
    model = hf_dsa_reference(build_dsa_checkpoint(tmp_path / kind, kind=kind, seed=0))
    topk = model.config.index_topk
    ids = torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    sel, scores = hf_topk(model, ids), reference_scores(model, ids)
    assert sorted(sel) == list(range(model.config.num_hidden_layers))
    for i, rows in sel.items():
        assert len(rows) == len(ids)
        for t, s in enumerate(rows):
            assert len(s) == min(topk, t + 1) and max(s) <= t
        window = [frozenset(range(t - topk + 1, t + 1)) for t in range(len(ids))]
        assert any(rows[t] != window[t] for t in range(topk, len(ids)))  # sparse, and not a sliding window
        sc = scores[i]
        assert sc.dtype == torch.float32 and sc.shape == (len(ids), len(ids))
        assert torch.isinf(sc.triu(1)[sc.triu(1) != 0]).all()
        gaps = boundary_gaps(sc, topk)
        for t in range(len(ids)):
            if not gaps[t] < 1e-5:  # NaN (no boundary) or a clear gap
                assert frozenset(sc[t].topk(min(topk, t + 1)).indices.tolist()) == rows[t], (i, t)
    if kind == "glm":  # layer 1 is "shared": layer 0's selection and scores
        assert sel[1] == sel[0] and scores[1] is scores[0] and sel[2] != sel[0]
