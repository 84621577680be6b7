"""The analytical core on DSA models (DeepSeek-V3.2, GLM-5): bytes per token with the indexer keys (and the
paper's FP8 layout), per-layer manifest bytes, sparse attention pricing, and the plan/simulate CLI."""

import json

import numpy as np
import pytest

from splash.cli import main
from splash.core.costmodel import Batch, attended_keys, layer_kinds, layer_loads, outside_attention, step_cost
from splash.core.features import step_features, theta_params
from splash.core.hardware import theta_for
from splash.core.layouts import LAYOUTS, Layout
from splash.core.manifest import switch_manifest
from splash.core.presets import PRESETS
from splash.core.sizes import AttentionSizes, kv_bytes_per_token, kv_bytes_per_token_layer

V32, GLM5 = PRESETS["deepseek-v3.2"], PRESETS["glm-5"]


def run_json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- bytes per token ------------------------------------------------------------------------------
def test_v32_fp8_is_the_papers_48068_bytes_per_token():
    """Appendix B.1: (512 + 4*4 + 64*2 + 128 + 4) * 61, computed from the config's dims."""
    assert kv_bytes_per_token(V32, "fp8") == 48_068 == AttentionSizes(V32, "fp8", "fp8").k
    c = V32
    per_layer = c.kv_lora_rank + c.kv_lora_rank // 128 * 4 + c.qk_rope_head_dim * 2 + c.index_head_dim + 4
    assert per_layer * c.num_hidden_layers == 48_068
    # every dimension counts: not a constant
    assert kv_bytes_per_token(V32.replace(num_hidden_layers=60), "fp8") == 788 * 60
    assert kv_bytes_per_token(V32.replace(index_head_dim=256), "fp8") == (512 + 16 + 128 + 256 + 8) * 61
    assert kv_bytes_per_token(V32.replace(kv_lora_rank=640), "fp8") == (640 + 20 + 128 + 128 + 4) * 61
    assert kv_bytes_per_token(V32.replace(qk_rope_head_dim=32), "fp8") == (512 + 16 + 64 + 128 + 4) * 61


def test_other_dtypes_count_every_value_at_its_width():
    assert kv_bytes_per_token(V32, "bf16") == (576 + 128) * 2 * 61
    assert kv_bytes_per_token(V32, "fp32") == (576 + 128) * 4 * 61
    assert kv_bytes_per_token(V32, "float64") == (576 + 128) * 8 * 61
    dense = PRESETS["deepseek-v3"]
    assert kv_bytes_per_token(dense, "bf16") == 576 * 2 * 61  # a dense model has no indexer keys
    assert kv_bytes_per_token(dense, "fp8") == (512 + 16 + 128) * 61
    assert AttentionSizes(dense).k == AttentionSizes(dense).kv_token_layer * 61


def test_glm5_shared_layers_carry_no_indexer_bytes():
    tiny = PRESETS["tiny-glm5"]  # full, shared, full, shared
    s = AttentionSizes(tiny, "bf16", "bf16")
    latent, index = tiny.latent_dim * 2, tiny.index_head_dim * 2
    assert s.kv_layer_bytes == (latent + index, latent, latent + index, latent)
    assert s.k == sum(s.kv_layer_bytes) and s.kv_token_layer == latent + index
    # GLM-5's real dims, with a config that names shared layers (transformers' default: every layer full)
    assert GLM5.indexer_types is None and len(GLM5.indexer_layers) == 78
    half = GLM5.replace(indexer_types=("full", "shared") * 39)
    assert [kv_bytes_per_token_layer(half, "fp8", i) for i in (0, 1)] == [788, 656]
    assert kv_bytes_per_token(half, "fp8") == 39 * 788 + 39 * 656
    assert AttentionSizes(half, "fp8", "fp8").indexer_weight_bytes() == pytest.approx(
        AttentionSizes(GLM5, "fp8", "fp8").indexer_weight_bytes() / 2)


def test_indexer_projections_are_replicated_in_every_layout():
    s, d = AttentionSizes(V32, "bf16", "bf16"), AttentionSizes(PRESETS["deepseek-v3"], "bf16", "bf16")
    c = V32
    per_layer = (c.index_n_heads * c.index_head_dim * c.q_lora_rank + c.index_head_dim * c.hidden_size
                 + c.index_n_heads * c.hidden_size) * 2 + 2 * c.index_head_dim * 2
    assert s.indexer_layer_bytes == per_layer and s.indexer_weight_bytes() == per_layer * 61
    for sharded in (True, False):
        for r in range(8):
            extra = s.attention_weight_bytes(sharded, 8, r) - d.attention_weight_bytes(sharded, 8, r)
            assert extra == pytest.approx(s.indexer_weight_bytes())  # whole on every rank, never 1/T
    assert s.w_a == d.w_a  # W_A (what a switch moves) is the head-sharded projections only


# ---- manifests ------------------------------------------------------------------------------------
def test_manifest_bytes_per_layer_include_the_index_keys():
    tiny = PRESETS["tiny-glm5"]
    s = AttentionSizes(tiny, "bf16", "bf16")
    batch = [(300, 0, 0), (130, 1, 1), (77, 0, 0)]
    m = switch_manifest(s, "dp", "tp", batch, 2, page_size=16)
    tokens = np.asarray(m.kv.recv_bytes) / s.kv_token_layer
    assert tokens.tolist() == [130, 377]  # each rank gathers the other owner's histories
    for lm in m.layers:
        assert np.allclose(lm.kv.recv_bytes, tokens * s.kv_token_bytes(lm.layer))
        assert lm.kv.primitive == "all-gather"
    full, shared = m.layers[0].kv.bytes_per_rank, m.layers[1].kv.bytes_per_rank
    assert full / shared == pytest.approx((tiny.latent_dim + tiny.index_head_dim) / tiny.latent_dim)
    assert np.allclose(m.recv_bytes_per_rank(), tokens * s.k + np.asarray(m.weights.recv_bytes) * 4)
    assert sum(p.nbytes for p in m.kv_moves(1)) == pytest.approx(m.layers[1].kv.total_bytes)
    assert sum(p.nbytes for p in m.kv_moves()) == pytest.approx(m.kv.total_bytes)
    assert np.allclose(m.in_transit_bytes(), np.asarray(m.weights.recv_bytes) + m.layers[0].kv.recv_bytes)


def test_plan_switches_counts_the_index_keys(capsys):
    args = ["plan", "switches", "--ranks", "8", "--batch", "4", "--context", "4096"]
    v3 = run_json(capsys, *args, "--model", "deepseek-v3")
    v32 = run_json(capsys, *args, "--model", "deepseek-v3.2")
    assert v32["kv_bytes_per_token"] == (576 + 128) * 2 * 61
    for a, b in zip(v3["switches"], v32["switches"]):
        assert b["kv"]["bytes_group"] == pytest.approx(a["kv"]["bytes_group"] * 704 / 576)
    fp8 = run_json(capsys, *args, "--model", "deepseek-v3.2", "--kv-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] == 48_068 and fp8["kv_bytes_per_token_layer"] == {"788": 61}


# ---- the cost model -------------------------------------------------------------------------------
def test_attended_keys_is_the_exact_mean_of_capped_causal_rows():
    rng = np.random.default_rng(0)
    for _ in range(200):
        s = int(rng.integers(1, 400))
        q = int(rng.integers(1, s + 1))
        k = int(rng.integers(1, 500))
        brute = np.mean([min(v, k) for v in range(s - q + 1, s + 1)])
        assert attended_keys(np.array([s]), np.array([q]), k)[0] == pytest.approx(brute)
        assert attended_keys(np.array([s]), np.array([q]), None)[0] == pytest.approx((2 * s - q + 1) / 2)


def test_main_attention_stops_growing_beyond_topk_while_the_indexer_grows():
    s = AttentionSizes(V32, "fp8", "fp8")
    for lay in LAYOUTS:
        short = layer_loads(lay, s, Batch.balanced(16, 4096, 1, 8), 8, 2.0, 1, 64)
        long = layer_loads(lay, s, Batch.balanced(16, 65536, 1, 8), 8, 2.0, 1, 64)
        assert np.allclose(long.f_att, short.f_att) and np.allclose(long.kv_read, short.kv_read)
        assert np.allclose(long.f_index, 16 * short.f_index)  # every key scored (4096 -> 65536)
        assert np.allclose(long.index_read, 16 * short.index_read)
    th = theta_for("h200", 8, s)
    grow = [step_cost(Layout.DOP, s, Batch.balanced(16, n, 1, 8), th) for n in (4096, 65536)]
    assert grow[1].t_att - grow[1].t_index == pytest.approx(grow[0].t_att - grow[0].t_index)
    assert grow[1].t_index > 10 * grow[0].t_index


@pytest.mark.parametrize("rows", [1, 300])
def test_sparse_attention_with_topk_beyond_the_context_is_the_dense_models(rows):
    dense = AttentionSizes(PRESETS["deepseek-v3"], "bf16", "bf16")
    sparse = AttentionSizes(V32, "bf16", "bf16")
    batch = Batch.make([2048, 900, 1500], rows, [0, 1, 1], 2)  # every row sees <= index_topk keys
    for lay in LAYOUTS:
        a = layer_loads(lay, dense, batch, 2, 2.0, 1, 64)
        b = layer_loads(lay, sparse, batch, 2, 2.0, 1, 64)
        assert np.allclose(a.f_att, b.f_att) and np.allclose(a.kv_read, b.kv_read)
        assert a.f_index is None and b.f_index is not None and (b.f_index > 0).all()


def test_indexer_work_follows_the_kv_and_its_projections_every_rank():
    s = AttentionSizes(V32, "bf16", "bf16")
    batch = Batch.make([8192, 4096, 2048, 1024], 1, [0, 1, 2, 3], 4)
    tp = layer_loads(Layout.TP, s, batch, 4, 2.0, 1, 64)
    dp = layer_loads(Layout.DP, s, batch, 4, 2.0, 1, 64)
    dop = layer_loads(Layout.DOP, s, batch, 4, 2.0, 1, 64)
    assert np.allclose(tp.f_index, dp.f_index.sum())  # TP replicates the indexer: all rows on every rank
    assert np.allclose(dop.f_index, dp.f_index)  # DOP: each owner scores its own rows
    assert np.allclose(tp.index_read, 15360 * s.store_bytes("index_k"))
    ix = s.indexer_layer_bytes
    assert np.allclose(tp.w_read - s.w_layer / 4, ix) and np.allclose(dp.w_read - s.w_layer, ix)


@pytest.mark.parametrize("model", ["deepseek-v3.2", "tiny-glm5", "glm-5"])
def test_features_stay_linear_in_theta_for_dsa_models(model):
    s = AttentionSizes(PRESETS[model], "bf16", "bf16")
    T = 8 if model != "tiny-glm5" else 2
    th = theta_for("h200" if T == 8 else "cpu", T, s)
    assert sum(n for n, _ in layer_kinds(s)) == s.layers
    for batch in (Batch.balanced(T, 4096, 1, T), Batch.make([9000, 300, 5000, 64], [1, 300, 1, 64],
                                                            [0, 1, 0, 1], T)):
        for lay in LAYOUTS:
            cost = step_cost(lay, s, batch, th, 64)
            x = step_features(lay, s, batch, th, 64)
            assert x @ theta_params(th) == pytest.approx(cost.total, rel=1e-9)
            assert outside_attention(th, batch) + s.layers * cost.per_layer == pytest.approx(cost.total)


def test_glm5_shared_layers_pay_no_indexer():
    tiny = PRESETS["tiny-glm5"]
    s = AttentionSizes(tiny, "bf16", "bf16")
    every = AttentionSizes(tiny.replace(indexer_types=None), "bf16", "bf16")
    assert layer_kinds(s) == ((2, True), (2, False)) and layer_kinds(every) == ((4, True),)
    th = theta_for("cpu", 2, s)
    b = Batch.balanced(4, 512, 1, 2)
    half, full = step_cost(Layout.DP, s, b, th), step_cost(Layout.DP, every, b, th)
    assert half.t_index == pytest.approx(full.t_index / 2)
    assert half.t_att - half.t_index == pytest.approx(full.t_att - full.t_index)


# ---- the CLI ----------------------------------------------------------------------------------------
def test_plan_capacity_states_48068_bytes_per_token(capsys):
    argv = ["plan", "capacity", "--model", "deepseek-v3.2", "--kv-dtype", "fp8", "--cohorts", "2000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "48,068 bytes per token" in out
    d = run_json(capsys, *argv)
    assert d["kv_bytes_per_token"] == 48_068 and set(d["limits_k"]) == {"TP", "DP", "CP", "DOP"}
    assert d["pool_tokens"]["DOP"] > d["pool_tokens"]["DP"] > 0
    sc = run_json(capsys, "plan", "capacity", "--scenario", "h200", "--model", "deepseek-v3.2", "--kv-dtype",
                  "fp8", "--cohorts", "2000")
    assert sc["pool_tokens"]["TP"] == 1_000_832 and sc["kv_bytes_per_token"] == 48_068
    budget = run_json(capsys, "plan", "capacity", "--memory-gib", "52.8", "--model", "glm-5", "--kv-dtype",
                      "fp8", "--cohorts", "2000")
    assert budget["kv_bytes_per_token"] == 788 * 78


@pytest.mark.parametrize("model", ["deepseek-v3.2", "glm-5"])
def test_plan_and_simulate_answer_for_dsa_models(capsys, model):
    c = run_json(capsys, "plan", "crossovers", "--model", model, "--kv-dtype", "fp8")
    assert c["sparse"] and c["index_topk"] == 2048 and c["crossovers"]
    assert all(x["from"] != x["to"] for x in c["crossovers"])
    a = run_json(capsys, "plan", "advise", "--model", model, "--kv-dtype", "fp8", "--context", "65536")
    assert a["layout"] in a["feasible"] and a["layouts"]["TP"]["stages"]["t_index_s"] > 0
    r = run_json(capsys, "simulate", "rollout", "--model", model, "--kv-dtype", "fp8", "--requests", "12",
                 "--prompt-min", "1024", "--prompt-max", "4096", "--output-median", "256",
                 "--output-max", "2048")
    assert r["runs"]["policy"]["output_tokens"] == r["workload"]["output_tokens"]
    assert main(["plan", "crossovers", "--model", model]) == 0
    assert "bytes per token" in capsys.readouterr().out


def test_model_info_prints_the_indexer(capsys):
    d = run_json(capsys, "model", "info", "deepseek-v3.2")
    assert (d["index_n_heads"], d["index_head_dim"], d["index_topk"]) == (64, 128, 2048)
    assert (d["indexer_layers"], d["shared_layers"]) == (61, 0)
    assert d["kv_bytes_per_token_fp8"] == 48_068 and d["kv_values_per_token"] == 704 * 61
    assert main(["model", "info", "glm-5"]) == 0
    out = capsys.readouterr().out
    assert "index_n_heads: 32" in out and "interleaved" in out


def test_crossovers_model_refuses_the_laws_flags(capsys):
    assert main(["plan", "crossovers", "--model", "deepseek-v3.2", "--limits", "paper"]) == 2
    assert "belong to the illustrative law" in capsys.readouterr().err


def test_presets_are_transformers_configs():
    """glm-5 is GlmMoeDsaConfig's defaults read by ModelConfig.from_dict (every layer full); deepseek-v3.2
    is DeepseekV32Config's dims (with DeepSeek-V3's yarn rotary, which the hub checkpoint carries)."""
    tf = pytest.importorskip("transformers")
    from splash.core.model_config import ModelConfig

    assert ModelConfig.from_dict(tf.GlmMoeDsaConfig().to_dict(), name="glm-5") == GLM5
    v32 = ModelConfig.from_dict(tf.DeepseekV32Config().to_dict(), name="deepseek-v3.2")
    assert v32 == V32.replace(rope_scaling=None)
