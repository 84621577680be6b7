"""The built-in model shapes (`PRESETS`): the paper's models (DeepSeek-V3, Kimi-K2, V3.2, GLM-5, the hybrids)
with their real dimensions for the analytical core, and the small ones the runtime writes as checkpoints
(tiny, small, tiny-dsa, ...); `resolve_model_config` reads a name or a checkpoint directory."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from splash.core.model_config import ConfigError, ModelConfig


def _yarn(factor: float, orig: int, mscale: float, mscale_all_dim: float, beta_fast: float = 32,
          beta_slow: float = 1) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim, "beta_fast": beta_fast,
            "beta_slow": beta_slow}


PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=3, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=_yarn(40, 4096, 1.0, 1.0), bos_token_id=0, eos_token_id=1,
    ),
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy",
        scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
        first_k_dense_replace=1, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=_yarn(40, 4096, 0.707, 0.707), bos_token_id=100000, eos_token_id=100001,
    ),
    "kimi-k2": ModelConfig(
        name="kimi-k2", model_type="kimi_k2", vocab_size=163840, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827,
        first_k_dense_replace=1, max_position_embeddings=131072, rope_theta=50000.0,
        rope_scaling=_yarn(32, 4096, 1.0, 1.0, beta_fast=1, beta_slow=1),
        bos_token_id=163584, eos_token_id=163585,
    ),
    # DeepSeek Sparse Attention at full size. V3.2: DeepSeek-V3's dims plus a lightning indexer in every
    # layer (transformers' DeepseekV32Config). GLM-5: transformers' GlmMoeDsaConfig defaults (the hub's
    # zai-org/GLM-5 dims); its default indexer_types derive from index_topk_freq = 1, i.e. every layer
    # runs its own indexer (a checkpoint whose config.json names "shared" layers gets them at load).
    "deepseek-v3.2": ModelConfig(
        name="deepseek-v3.2", model_type="deepseek_v32", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=3, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=_yarn(40, 4096, 1.0, 1.0), bos_token_id=0, eos_token_id=1,
        index_topk=2048, index_head_dim=128, index_n_heads=64, index_rope_interleave=False,
    ),
    "glm-5": ModelConfig(
        name="glm-5", model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
        intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78,
        num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=3, rms_norm_eps=1e-5, max_position_embeddings=202752, rope_theta=10000.0,
        rope_scaling=None, bos_token_id=0, eos_token_id=1,
        index_topk=2048, index_head_dim=128, index_n_heads=32, indexer_types=None,
        index_rope_interleave=True,
    ),
    # The built-in default model: DeepSeek-V3 architecture at toy size (MoE included), so CPU demos
    # and multi-rank tests are quick. 8 heads split over T = 1, 2, 4, 8.
    "tiny": ModelConfig(
        name="tiny", model_type="deepseek_v3", vocab_size=320, hidden_size=256,
        intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=1, max_position_embeddings=4096, rope_theta=10000.0,
        rope_scaling=None, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    ),
}

# The built-in benchmark model: DeepSeek-V3's real MLA per-head dims (latent 512 + rope 64, nope 128,
# v 128; 16 heads = what one rank of DeepSeek-V3 holds at TP=8) on a small body (hidden 512, 4 layers,
# 8 experts) and tiny's tokenizer, so benchmarks exercise the shapes deployments and peer kernels use
# (vLLM's CPU MLA kernel wants head dim 576) while still fitting a laptop. Not for tests: ~120 MB.
# The same checkpoint as the one issue 13's "before" table was measured on (seed 0).
PRESETS["small"] = dataclasses.replace(
    PRESETS["tiny"], name="small", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
    num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128,
)

# The built-in DSA models (DeepSeek Sparse Attention): tiny's body with a lightning indexer in every layer
# (`tiny-dsa`, DeepSeek-V3.2's shape) or in every other layer with the rest sharing its top-k (`tiny-glm5`,
# GLM-5's shape, interleaved indexer rotary). index_topk = 16 sits well below the prompts tests use, so
# attention is really sparse there. `small-dsa`: `small` with an indexer whose cost per key relative to
# the main attention is about V3.2's (8 x 128 MACs against 16 heads x (576 + 512), ~6%), top-k 2048.
PRESETS["tiny-dsa"] = dataclasses.replace(
    PRESETS["tiny"], name="tiny-dsa", model_type="deepseek_v32", index_topk=16, index_head_dim=32,
    index_n_heads=8,
)
PRESETS["tiny-glm5"] = dataclasses.replace(
    PRESETS["tiny-dsa"], name="tiny-glm5", model_type="glm_moe_dsa",
    indexer_types=("full", "shared", "full", "shared"), index_rope_interleave=True,
)
PRESETS["small-dsa"] = dataclasses.replace(
    PRESETS["small"], name="small-dsa", model_type="deepseek_v32", index_topk=2048, index_head_dim=128,
    index_n_heads=8, max_position_embeddings=32768,
)


# Hybrids (SPEC §10): MLA layers interleaved with Kimi Delta Attention (KDA) layers, each KDA layer keeping a
# per-request recurrent state [heads, d, d] plus short-conv states instead of a per-token latent.
# `kimi-linear`: moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (linear_attn_config: 1-based
# full_attn_layers [4, 8, 12, 16, 20, 24, 27], i.e. 7 MLA layers, the last layer among them, and 20 KDA
# layers; 32 KDA heads of 128, conv 4; NoPE MLA without a query LoRA), which transformers' KimiLinearConfig
# defaults also give apart from the layer schedule.
PRESETS["kimi-linear"] = ModelConfig(
    name="kimi-linear", model_type="kimi_linear", vocab_size=163840, hidden_size=2304,
    intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
    num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446,
    first_k_dense_replace=1, rms_norm_eps=1e-5, max_position_embeddings=1048576, rope_theta=10000.0,
    rope_scaling=None, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    kda_layers=tuple(i for i in range(27) if i not in (3, 7, 11, 15, 19, 23, 26)),
    linear_num_heads=32, linear_head_dim=128, linear_conv_kernel=4, use_rope=False,
)
# `glm-5.3-flash`: the shape of the paper's GLM-5.3-Flash (§C.2, §H: "300B", 45 layers, 11 MLA and 34 KDA,
# INT8 weights, FP8 KV, TP16 decode). The paper states nothing else, so the rest is ASSUMED: MLA at every
# fourth layer (0-based 3, 7, ..., 43 -> 11 layers); GLM-5's MLA dims (hidden 6144, 64 heads, q LoRA 2048,
# latent 512 + 64, nope 192, v 256), NoPE as in Kimi-Linear (the kimi_linear model type has no rotary) and
# without GLM-5's DSA indexer (splash does not combine DSA with KDA); Kimi-Linear's KDA head dim 128 with
# 64 KDA heads (= the MLA heads, so T = 16 divides both); GLM-5's dense prefix (3), vocab and router; 192
# routed experts of 2048 (12 per rank at EP16), which with the rest comes to ~315B parameters.
PRESETS["glm-5.3-flash"] = ModelConfig(
    name="glm-5.3-flash", model_type="kimi_linear", vocab_size=154880, hidden_size=6144,
    intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=45,
    num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=192, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    first_k_dense_replace=3, rms_norm_eps=1e-5, max_position_embeddings=1048576, rope_theta=10000.0,
    rope_scaling=None, bos_token_id=0, eos_token_id=1,
    kda_layers=tuple(i for i in range(45) if i % 4 != 3),
    linear_num_heads=64, linear_head_dim=128, linear_conv_kernel=4, use_rope=False,
)
# The built-in hybrid models. `tiny-hybrid`: tiny's body as Kimi-Linear (KDA layers 0-2, NoPE MLA at layer
# 3, no query LoRA), 8 KDA heads of 32 so T = 1, 2, 4, 8 split both kinds of heads. `small-hybrid`: small's
# body and MLA dims (latent 512 + 64, 16 heads) with 3 KDA layers + 1 MLA layer, 16 KDA heads of 128:
# Kimi-Linear's real KDA head dim (the 128 x 128 state the FLA/vLLM kernels are built for), and one KDA
# layer's head-sliced projections (q, k, v, o: 4 x 2048 x 512 = 4.2M) then about match small's MLA layer's
# (q 3072 x 512, kv_b 4096 x 512, o 512 x 2048 = 4.7M), so switches move comparable weights per layer.
PRESETS["tiny-hybrid"] = dataclasses.replace(
    PRESETS["tiny"], name="tiny-hybrid", model_type="kimi_linear", q_lora_rank=None, first_k_dense_replace=1,
    kda_layers=(0, 1, 2), linear_num_heads=8, linear_head_dim=32, linear_conv_kernel=4, use_rope=False,
)
PRESETS["small-hybrid"] = dataclasses.replace(
    PRESETS["small"], name="small-hybrid", model_type="kimi_linear", q_lora_rank=None,
    first_k_dense_replace=1, kda_layers=(0, 1, 2), linear_num_heads=16, linear_head_dim=128,
    linear_conv_kernel=4, use_rope=False,
)


def resolve_model_config(model: str) -> ModelConfig:
    """A preset name, a checkpoint directory, or a config.json path -> ModelConfig."""
    if model in PRESETS:
        return PRESETS[model]
    if os.path.exists(model):
        return ModelConfig.from_hf(model)
    raise ConfigError(
        f"unknown model {model!r}: use a preset ({', '.join(PRESETS)}), a checkpoint directory, "
        f"or a path to config.json"
    )
