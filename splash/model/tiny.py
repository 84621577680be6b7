"""The built-in models: PRESETS["tiny"] (tests, demos) and PRESETS["small"] (benchmarks with DeepSeek-V3's
real MLA dims) written as real Hugging Face checkpoints, and their DeepSeek Sparse Attention variants
PRESETS["tiny-dsa"] (DeepSeek-V3.2, DeepseekV32ForCausalLM), PRESETS["tiny-glm5"] (GLM-5,
GlmMoeDsaForCausalLM: every other layer shares the previous indexer's top-k) and PRESETS["small-dsa"], and
the KDA hybrids PRESETS["tiny-hybrid"] / PRESETS["small-hybrid"] (Kimi-Linear, KimiLinearForCausalLM:
Kimi's tensor names, `block_sparse_moe` and experts' w1/w2/w3).

Deterministic random weights (a seed), scaled so activations stay O(1) through the layers and the
logits are neither flat nor one-hot, plus a byte-level BPE tokenizer built here with `tokenizers` from a
short built-in text, with BOS/EOS/PAD at the preset's ids. No download, no transformers needed;
transformers can still load the result (DeepseekV3ForCausalLM, or the DSA classes) for comparisons.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from splash import env
from splash.core.model_config import ConfigError, ModelConfig
from splash.core.presets import PRESETS

TINY_VERSION = "1"
# names `--model` takes besides a checkpoint directory
BUILTIN_MODELS = ("tiny", "small", "tiny-dsa", "tiny-glm5", "small-dsa", "tiny-hybrid", "small-hybrid")
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                 "kimi_linear": "KimiLinearForCausalLM"}
SPECIALS = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
CORPUS = """\
The quick brown fox jumps over the lazy dog. A model that serves many requests at once keeps the
keys and values of every token in a cache, and the cache is split into pages. Attention reads the
pages of each request; the layout decides which rank holds which pages and which heads. When the
batch is large, data parallel attention saves memory; when the context is long, context parallel
attention spreads the pages. The server streams tokens to the client as soon as they are ready.
Hello, world! How are you today? I am fine, thank you. What is the weather like in the city?
It is sunny and warm, with a light wind from the west. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json for a ModelConfig, in the form transformers 5 reads (and ModelConfig.from_hf)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    arch = ARCHITECTURES.get(cfg.model_type, "DeepseekV3ForCausalLM")
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
            "first_k_dense_replace", "rms_norm_eps", "rope_interleave", "max_position_embeddings",
            "tie_word_embeddings", "attention_bias", "hidden_act", "bos_token_id", "eos_token_id",
            "pad_token_id")
    d = {k: getattr(cfg, k) for k in keys}
    d.update(architectures=[arch], model_type=cfg.model_type, num_key_value_heads=cfg.num_attention_heads,
             rope_parameters=rope, rope_theta=cfg.rope_theta, dtype="float32", initializer_range=0.02)
    if cfg.num_nextn_predict_layers:
        d["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
    if cfg.is_sparse:
        # DSA: the indexer's dims; transformers' dense/MoE pattern written out as its save_pretrained does
        # (it derives the same from first_k_dense_replace, ignoring moe_layer_freq); GLM-5's per-layer
        # indexer pattern as a list ("full" everywhere when the preset has none).
        d.update(index_topk=cfg.index_topk, index_head_dim=cfg.index_head_dim,
                 index_n_heads=cfg.index_n_heads,
                 mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense"
                                  for i in range(cfg.num_hidden_layers)])
        if cfg.model_type == "glm_moe_dsa":
            d["indexer_types"] = [cfg.indexer_type(i) for i in range(cfg.num_hidden_layers)]
    if cfg.model_type == "kimi_linear":
        return _kimi_config(cfg, d)
    return d


def _kimi_config(cfg: ModelConfig, d: dict) -> dict:
    """Kimi-Linear's config.json (KimiLinearConfig's names: num_experts, moe_renormalize, ...; layers
    1-based in linear_attn_config, as the hub's checkpoints write them)."""
    n = cfg.num_hidden_layers
    out = {k: v for k, v in d.items() if k not in (
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "norm_topk_prob",
        "topk_method", "scoring_func", "rope_interleave", "rope_parameters", "rope_theta",
        "max_position_embeddings")}
    kda = [i + 1 for i in range(n) if cfg.layer_kind(i) == "kda"]
    out.update(num_experts=cfg.n_routed_experts, num_shared_experts=cfg.n_shared_experts,
               num_experts_per_token=cfg.num_experts_per_tok, num_expert_group=cfg.n_group,
               moe_renormalize=cfg.norm_topk_prob, model_max_length=cfg.max_position_embeddings,
               linear_attn_config={"num_heads": cfg.linear_num_heads, "head_dim": cfg.linear_head_dim,
                                   "short_conv_kernel_size": cfg.linear_conv_kernel, "kda_layers": kda,
                                   "full_attn_layers": [i + 1 for i in range(n) if i + 1 not in kda]},
               mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(n)])
    return out


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepSeek-family checkpoint (HF names) and its shape."""
    d, H = cfg.hidden_size, cfg.num_attention_heads
    dq, dkv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d),
                                     "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, d)

    def mlp(p: str, inter: int) -> None:
        s.update({f"{p}.gate_proj.weight": (inter, d), f"{p}.up_proj.weight": (inter, d),
                  f"{p}.down_proj.weight": (d, inter)})

    n = cfg.num_hidden_layers
    for i in range(n + cfg.num_nextn_predict_layers):  # MTP layers last (earlier tensors stay as they were)
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if i >= n:  # an MTP layer's own tensors (splash/model/mtp.py), then a decoder layer's
            v = cfg.vocab_size
            s.update({f"{p}.enorm.weight": (d,), f"{p}.hnorm.weight": (d,), f"{p}.eh_proj.weight": (d, 2 * d),
                      f"{p}.shared_head.norm.weight": (d,), f"{p}.shared_head.head.weight": (v, d),
                      f"{p}.embed_tokens.weight": (v, d)})
        s[f"{p}.input_layernorm.weight"] = (d,)
        s[f"{p}.post_attention_layernorm.weight"] = (d,)
        if cfg.q_lora_rank:
            s[f"{a}.q_a_proj.weight"] = (cfg.q_lora_rank, d)
            s[f"{a}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            s[f"{a}.q_b_proj.weight"] = (H * dq, cfg.q_lora_rank)
        else:
            s[f"{a}.q_proj.weight"] = (H * dq, d)
        s[f"{a}.kv_a_proj_with_mqa.weight"] = (cfg.latent_dim, d)
        s[f"{a}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        s[f"{a}.kv_b_proj.weight"] = (H * dkv, cfg.kv_lora_rank)
        s[f"{a}.o_proj.weight"] = (d, H * cfg.v_head_dim)
        if cfg.layer_kind(i) == "kda":  # Kimi Delta Attention: its own tensors, no MLA ones
            for k in [k for k in s if k.startswith(f"{a}.")]:
                del s[k]
            H, hd, K = cfg.linear_num_heads, cfg.linear_qkv_dim, cfg.linear_conv_kernel
            dh = cfg.linear_head_dim
            for c in "qkv":
                s[f"{a}.{c}_proj.weight"] = (hd, d)
                s[f"{a}.{c}_conv1d.weight"] = (hd, 1, K)
            s.update({f"{a}.f_a_proj.weight": (dh, d), f"{a}.f_b_proj.weight": (hd, dh),
                      f"{a}.dt_bias": (hd,), f"{a}.A_log": (1, 1, H, 1), f"{a}.b_proj.weight": (H, d),
                      f"{a}.g_a_proj.weight": (dh, d), f"{a}.g_b_proj.weight": (hd, dh),
                      f"{a}.o_norm.weight": (dh,), f"{a}.o_proj.weight": (d, hd)})
        if cfg.indexer_type(i) == "full":  # DSA's lightning indexer (a "shared" GLM-5 layer has none)
            x = f"{a}.indexer"
            s[f"{x}.wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, int(cfg.q_lora_rank))
            s[f"{x}.wk.weight"] = (cfg.index_head_dim, d)
            s[f"{x}.k_norm.weight"] = (cfg.index_head_dim,)  # a LayerNorm (eps 1e-6): weight and bias
            s[f"{x}.k_norm.bias"] = (cfg.index_head_dim,)
            s[f"{x}.weights_proj.weight"] = (cfg.index_n_heads, d)
        if cfg.is_moe_layer(i):
            s[f"{p}.mlp.gate.weight"] = (int(cfg.n_routed_experts), d)
            if cfg.model_type != "deepseek_v2":
                s[f"{p}.mlp.gate.e_score_correction_bias"] = (int(cfg.n_routed_experts),)
            for e in range(int(cfg.n_routed_experts)):
                mlp(f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size)
            if cfg.n_shared_experts:
                mlp(f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * int(cfg.n_shared_experts))
        else:
            mlp(f"{p}.mlp", cfg.intermediate_size)
    if cfg.model_type == "kimi_linear":  # Kimi's MoE names
        from splash.model.loader import checkpoint_name

        return {checkpoint_name(cfg.model_type, k): v for k, v in s.items()}
    return s


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """N(0, 1/fan_in) projections (residual outputs x0.7), unit norms, N(0, 1) embeddings; the DSA
    indexer's LayerNorm bias N(0, 0.1^2), its projections N(0, 1/fan_in) like the others, so its index
    scores are O(1) and spread (few exact ReLU-zero ties).

    The LM-head rows of control / non-ASCII bytes and of BOS/PAD are shrunk 10x, so greedy text from
    this random model is mostly printable; the residual scale keeps greedy runs from settling into
    one repeated token (both picked by trying a few settings on short prompts)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(shape)
        elif name.endswith("k_norm.bias"):  # the DSA indexer's LayerNorm
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif name.endswith(".A_log"):  # KDA decay rates in [1, 16], as FLA initialises them
            t = (1.0 + 15.0 * torch.rand(shape, generator=g)).log()
        elif name.endswith(".dt_bias"):  # softplus^-1 of dt in [1e-3, 1e-1] (log-uniform), FLA's init
            u = torch.rand(shape, generator=g)
            dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * u)
            t = dt + torch.log(-torch.expm1(-dt))
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        elif name.endswith(".embed_tokens.weight"):  # an MTP layer's copies of the embedding and head
            t = out["model.embed_tokens.weight"].clone()
        elif name.endswith("shared_head.head.weight"):
            t = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t * 0.7
            elif name == "lm_head.weight":
                t = t * 2.0  # logits of a few units: varied but not flat
                quiet = [b for b in range(min(256, shape[0])) if not (32 <= b < 127 or b == 10)]
                quiet += [i for i in (cfg.bos_token_id, cfg.pad_token_id) if i is not None and i < shape[0]]
                t[quiet] *= 0.1
        out[name] = t.to(torch.float32).contiguous()
    return out


def build_byte_tokenizer(vocab_size: int, special_ids: dict[str, int]):
    """Byte-level BPE: ids 0-255 are the bytes, specials at their given ids, merges (learnt from
    CORPUS) fill the remaining ids in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    free = sorted(set(range(256, vocab_size)) - set(special_ids.values()))
    ok = all(256 <= i < vocab_size for i in special_ids.values())
    if not ok or len(free) + 256 + len(special_ids) != vocab_size:
        raise ConfigError("tiny tokenizer: special ids must be distinct and lie in [256, vocab_size)")
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + len(free), initial_alphabet=byte_chars,
                                  show_progress=False, min_frequency=2)
    learner.train_from_iterator(CORPUS.splitlines(), trainer)
    merges = json.loads(learner.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges][: len(free)]
    # byte b -> its printable stand-in, in byte order (GPT-2's table)
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for (a, b), i in zip(merges, free):
        vocab[a + b] = i
    for key, i in special_ids.items():
        vocab[SPECIALS[key]] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([SPECIALS[k] for k in special_ids])
    bos = SPECIALS["bos"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, special_ids["bos"])])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tiny_model(path: str | os.PathLike[str], seed: int = 0, cfg: ModelConfig | None = None) -> str:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to `path`."""
    cfg = cfg or PRESETS["tiny"]
    p = os.fspath(path)
    os.makedirs(p, exist_ok=True)
    specials = {"bos": cfg.bos_token_id, "eos": cfg.eos_token_ids[0], "pad": cfg.pad_token_id}
    tok = build_byte_tokenizer(cfg.vocab_size, specials)
    tok.save(os.path.join(p, "tokenizer.json"))
    tcfg = {"bos_token": SPECIALS["bos"], "eos_token": SPECIALS["eos"], "pad_token": SPECIALS["pad"],
            "chat_template": CHAT_TEMPLATE, "model_max_length": cfg.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    _dump(os.path.join(p, "tokenizer_config.json"), tcfg)
    _dump(os.path.join(p, "special_tokens_map.json"),
          {k + "_token": v for k, v in SPECIALS.items()})
    _dump(os.path.join(p, "config.json"), hf_config_dict(cfg))
    _dump(os.path.join(p, "generation_config.json"), {"bos_token_id": cfg.bos_token_id,
                                                      "eos_token_id": cfg.eos_token_id,
                                                      "pad_token_id": cfg.pad_token_id})
    weights = os.path.join(p, "model.safetensors")
    save_file(random_weights(cfg, seed), weights, metadata={"format": "pt"})
    os.chmod(weights, os.stat(os.path.join(p, "config.json")).st_mode & 0o777)  # (it writes 0600)
    return p


def _dump(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def cache_dir() -> str:
    """Where built-in models, tokenizers and compiled kernels are cached ($SPLASH_CACHE, splash/env.py)."""
    return env.text("SPLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "splash")


def write_builtin_model(path: str | os.PathLike[str], name: str = "tiny", seed: int = 0) -> str:
    """Write the built-in model `name` (one of BUILTIN_MODELS) to `path`; all share tiny's tokenizer."""
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"no built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    return write_tiny_model(path, seed=seed, cfg=PRESETS[name])


def ensure_tiny_model() -> str:
    return ensure_builtin_model("tiny")


def ensure_builtin_model(name: str = "tiny") -> str:
    """Path of the built-in model `name`, written on first use. Race-safe: built in a temp folder next to
    the target and renamed into place; whoever renames first wins, the others discard theirs."""
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"no built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    # the preset is part of the name, so editing PRESETS[name] never serves a stale checkpoint
    tag = hashlib.sha1(repr(PRESETS[name]).encode()).hexdigest()[:8]
    final = os.path.join(cache_dir(), f"{name}-v{TINY_VERSION}-{tag}")
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(final))
    try:
        write_builtin_model(tmp, name, seed=0)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "model.safetensors")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
