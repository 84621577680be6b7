"""`splash model train-mtp` (splash.training.mtp) at toy size: the checkpoint transformers and splash load,
its main logits are transformers', the MTP layer's tensors carry DeepSeek-V3's names and shapes and
compute what SGLang's / vLLM's MTP layer computes, and a seed gives the same weights twice."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from splash.core.model_config import ConfigError
from splash.training.mtp import (
    DEFAULT_DIMS,
    TRAIN_VERSION,
    MTPModel,
    Trained,
    checkpoint_tensors,
    load_mtp_model,
    model_config,
    resolve_dims,
    shape_dims,
    train,
    train_mtp_model,
    write_checkpoint,
)

pytest.importorskip("transformers")

DIMS = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "max_position_embeddings": 256}
KW = {"seed": 3, "steps": 3, "vocab_size": 512, "seq_len": 32, "batch_size": 2, "warmup": 2, "dims": DIMS,
      "corpus_bytes": 150_000, "eval_windows": 2, "progress": False, "log": lambda s: None}
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", "train_info.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trained, str]:
    t = train(**KW)
    path = write_checkpoint(str(tmp_path_factory.mktemp("mtp") / "a"), t.model, t.cfg, t.tokenizer, t.info)
    return t, path


def _ids(path: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok("import os\n\n\ndef main(argv=None):\n    return 0\n", return_tensors="pt").input_ids


def test_files_and_info(trained: tuple[Trained, str]) -> None:
    _, path = trained
    assert all(os.path.isfile(os.path.join(path, f)) for f in FILES)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    info = json.load(open(os.path.join(path, "train_info.json")))
    assert info["seed"] == 3 and info["steps"] == 3 and info["tokens_seen"] == 3 * 2 * 32
    assert {"main_top1", "mtp_top1", "mtp_agrees_main", "mtp_loss"} <= set(info["heldout"])
    assert info["version"] == TRAIN_VERSION
    assert info["shape"] == {"vocab_size": 512, **resolve_dims(dims=DIMS)}
    assert info["shape"]["num_hidden_layers"] == 2 and info["shape"]["hidden_size"] == 64
    assert info["mtp_layer_parameters"] == info["parameters"] - info["main_parameters"] > 0


def _has(d: dict, **want: int) -> bool:
    return {k: d[k] for k in want} == want


def test_default_shape_is_deep_and_narrow() -> None:
    """The benchmark model is DeepSeek-V3-shaped: many narrow layers, so the one MTP layer is a small
    share of a step; MLA dims valid (heads x v_head_dim = hidden)."""
    d = DEFAULT_DIMS
    assert TRAIN_VERSION == "2" and d == shape_dims() == resolve_dims()
    assert _has(d, num_hidden_layers=16, hidden_size=128, num_attention_heads=4, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=64, q_lora_rank=96, intermediate_size=384,
                moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1)
    for h in (32, 64, 128, 256, 512):
        s = shape_dims(3, h)
        assert s["num_attention_heads"] * s["v_head_dim"] == h and s["num_hidden_layers"] == 3


def test_shape_arguments() -> None:
    assert resolve_dims(layers=5)["num_hidden_layers"] == 5
    s = resolve_dims(hidden_size=256)
    assert _has(s, hidden_size=256, num_attention_heads=8, kv_lora_rank=128, num_hidden_layers=16)
    s = resolve_dims(layers=3, dims={"hidden_size": 64, "n_routed_experts": 4})  # dims' width, derived rest
    assert _has(s, num_hidden_layers=3, hidden_size=64, num_attention_heads=2, n_routed_experts=4)
    for kw, msg in (({"layers": 0}, "layers must be"), ({"hidden_size": 100}, "multiple of 32"),
                    ({"layers": 3, "dims": {"num_hidden_layers": 4}}, "contradicts"),
                    ({"dims": {"bogus": 1}}, "unknown model dims")):
        with pytest.raises(ConfigError, match=msg):
            resolve_dims(**kw)
    cfg = model_config(512, {"num_hidden_layers": 3, "hidden_size": 64})  # a derived shape builds and saves
    names = checkpoint_tensors(MTPModel(cfg), cfg)
    assert "model.layers.3.eh_proj.weight" in names
    assert names["model.layers.0.self_attn.o_proj.weight"].shape == (64, 64)


def test_tokenizer_loads_in_transformers_and_splash(trained: tuple[Trained, str]) -> None:
    from transformers import AutoTokenizer

    from splash.tokenizer import load_tokenizer

    _, path = trained
    hf, ours = AutoTokenizer.from_pretrained(path), load_tokenizer(path)
    text = "for i in range(10):\n    print(i)\n"
    assert hf(text).input_ids == ours.encode(text)
    assert ours.encode(text)[0] == ours.bos_token_id == 0 and ours.eos_token_id == 1
    assert ours.decode(ours.encode(text)) == text


def test_transformers_logits_are_the_trained_models(trained: tuple[Trained, str]) -> None:
    from transformers import AutoModelForCausalLM

    t, path = trained
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _ids(path)
    t.model.eval()
    with torch.no_grad():
        main, mtp = t.model(ids)
        torch.testing.assert_close(hf(ids).logits, main, atol=1e-5, rtol=1e-5)
        main2, mtp2 = load_mtp_model(path)(ids)  # the reference the serving side can compare against
    torch.testing.assert_close(main2, main, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mtp2, mtp, atol=1e-5, rtol=1e-5)


def test_mtp_tensor_names_and_shapes(trained: tuple[Trained, str]) -> None:
    _, path = trained
    w = load_file(os.path.join(path, "model.safetensors"))
    d, V, L, E = 64, 512, 2, 4
    p = f"model.layers.{L}."
    want = {"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d),
            "shared_head.norm.weight": (d,), "shared_head.head.weight": (V, d), "embed_tokens.weight": (V, d),
            "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
            "self_attn.q_a_proj.weight": (32, d), "self_attn.q_a_layernorm.weight": (32,),
            "self_attn.q_b_proj.weight": (2 * 24, 32), "self_attn.kv_a_proj_with_mqa.weight": (32 + 8, d),
            "self_attn.kv_a_layernorm.weight": (32,), "self_attn.kv_b_proj.weight": (2 * 32, 32),
            "self_attn.o_proj.weight": (d, 2 * 16), "mlp.gate.weight": (E, d),
            "mlp.gate.e_score_correction_bias": (E,), "mlp.shared_experts.gate_proj.weight": (32, d),
            "mlp.shared_experts.up_proj.weight": (32, d), "mlp.shared_experts.down_proj.weight": (d, 32)}
    for e in range(E):
        want.update({f"mlp.experts.{e}.gate_proj.weight": (32, d), f"mlp.experts.{e}.up_proj.weight": (32, d),
                     f"mlp.experts.{e}.down_proj.weight": (d, 32)})
    got = {k.removeprefix(p): tuple(v.shape) for k, v in w.items() if k.startswith(p)}
    assert got == want
    assert not any(k.startswith(f"model.layers.{L + 1}.") for k in w)
    assert torch.equal(w[p + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w[p + "shared_head.head.weight"], w["lm_head.weight"])


def test_mtp_layer_is_deepseek_v3s(trained: tuple[Trained, str]) -> None:
    """Recompute the MTP logits from the checkpoint with transformers alone: its decoder layer L (a model
    loaded with L+1 layers), h = the main model's post-norm hidden, x = eh_proj([enorm(e), hnorm(h)])."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    t, path = trained
    L = 2
    w = load_file(os.path.join(path, "model.safetensors"))
    cfg = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg.num_hidden_layers = L + 1
    deep = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    ids = _ids(path)
    n = ids.shape[1] - 1

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        m = DeepseekV3RMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        m.weight.data.copy_(w[f"model.layers.{L}.{name}"])
        return m(x)

    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[:, :-1]
        e = torch.nn.functional.embedding(ids[:, 1:], w[f"model.layers.{L}.embed_tokens.weight"])
        x = torch.cat([norm("enorm.weight", e), norm("hnorm.weight", h)], -1)  # embedding first
        x = x @ w[f"model.layers.{L}.eh_proj.weight"].T
        pos = torch.arange(n).unsqueeze(0)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = deep.model.layers[L](x, attention_mask=mask, position_ids=pos,
                                 position_embeddings=deep.model.rotary_emb(x, pos))
        logits = norm("shared_head.norm.weight", x) @ w[f"model.layers.{L}.shared_head.head.weight"].T
        t.model.eval()
        _, mtp = t.model(ids)
    torch.testing.assert_close(logits, mtp, atol=1e-5, rtol=1e-5)


def test_same_seed_same_weights(trained: tuple[Trained, str], tmp_path: os.PathLike) -> None:
    _, path = trained
    again = train_mtp_model(str(tmp_path / "b"), **KW)
    a = load_file(os.path.join(path, "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for f in ("tokenizer.json", "config.json"):
        assert open(os.path.join(path, f)).read() == open(os.path.join(again, f)).read()
    assert isinstance(load_mtp_model(again), MTPModel)


def test_cli_refuses_bad_arguments(trained: tuple[Trained, str], capsys: pytest.CaptureFixture[str],
                                   tmp_path: os.PathLike) -> None:
    from splash.cli import main

    _, path = trained
    for bad, msg in (([path], "--force"), ([str(tmp_path / "x"), "--steps", "0"], "--steps must be"),
                     ([str(tmp_path / "x"), "--minutes", "-1"], "--minutes must be"),
                     (["/proc/splash-mtp"], "cannot write"), ([""], "give the directory"),
                     ([str(tmp_path / "x"), "--layers", "0"], "--layers must be"),
                     ([str(tmp_path / "x"), "--layers", "9999"], "layers must be"),
                     ([str(tmp_path / "x"), "--hidden-size", "100"], "--hidden-size must be")):
        assert main(["model", "train-mtp", *bad]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err


def test_cli_passes_the_shape(trained: tuple[Trained, str], capsys: pytest.CaptureFixture[str],
                              tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch) -> None:
    import splash.training.mtp as train_mod
    from splash.cli import main

    _, path = trained
    seen: list[dict] = []
    monkeypatch.setattr(train_mod, "train_mtp_model", lambda out, **kw: (seen.append(kw), path)[1])
    assert main(["model", "train-mtp", str(tmp_path / "y"), "--layers", "12", "--hidden-size", "96",
                 "--steps", "5"]) == 0
    assert seen[0]["layers"] == 12 and seen[0]["hidden_size"] == 96 and seen[0]["steps"] == 5
    assert main(["model", "train-mtp", str(tmp_path / "z"), "--steps", "5"]) == 0
    assert seen[1]["layers"] is None and seen[1]["hidden_size"] is None  # train's default: 16 x 128
    out = capsys.readouterr().out
    assert "2 layers + 1 MTP layer, hidden 64" in out
