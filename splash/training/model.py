"""The trained model: its shape (deep and narrow like DeepSeek-V3, `shape_dims`), its configs, and the
module trained: transformers' DeepseekV3ForCausalLM plus one MTP layer (DeepSeek-V3's depth-1 module,
SGLang's and vLLM's conventions: post-norm hidden, embedding first) sharing the main model's embedding
and head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splash.core.model_config import ConfigError, ModelConfig

# The default shape: DeepSeek-V3's architecture, deep and narrow like the real one (61 layers + 1 MTP
# layer), so the MTP layer is a small share of a target step (on CPU at batch 1 every layer costs about the
# same: at 4 layers a chain of 3 drafts cost ~75% of a step). 16 x 128 has about 4 x 256's matmul FLOPs
# per token, but trains ~1.4x slower per token on 2 cores (each layer's attention scores cost the same at
# any width, and 4x the layers run 4x the small ops).
DEFAULT_LAYERS = 16
DEFAULT_HIDDEN = 128
HEAD_DIM = 32  # qk_nope_head_dim = v_head_dim; heads = hidden / HEAD_DIM, so heads * v_head_dim = hidden
ROPE_DIM = 16
MAX_LAYERS = 256


def shape_dims(layers: int = DEFAULT_LAYERS, hidden_size: int = DEFAULT_HIDDEN) -> dict[str, Any]:
    """The model dims that follow from a depth and a width: MLA with hidden/32 heads of 32 (+16 rope),
    q_lora_rank 3/4 hidden, kv_lora_rank max(64, hidden/2); one dense first layer (intermediate 3 x hidden),
    then MoE: 8 routed experts top-2 plus 1 shared, expert intermediate hidden/2. At 16 x 128: 4 heads,
    q_lora_rank 96, kv_lora_rank 64, dense 384, experts 64."""
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise ConfigError(f"layers must be an integer in [1, {MAX_LAYERS}], got {layers!r}")
    if (isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size % HEAD_DIM
            or not HEAD_DIM <= hidden_size <= 4096):
        raise ConfigError(f"hidden size must be a multiple of {HEAD_DIM} in [{HEAD_DIM}, 4096] (heads of "
                          f"{HEAD_DIM}), got {hidden_size!r}")
    h = hidden_size
    return {"hidden_size": h, "intermediate_size": 3 * h, "moe_intermediate_size": h // 2,
            "num_hidden_layers": layers, "num_attention_heads": h // HEAD_DIM, "q_lora_rank": 3 * h // 4,
            "kv_lora_rank": max(64, h // 2), "qk_nope_head_dim": HEAD_DIM, "qk_rope_head_dim": ROPE_DIM,
            "v_head_dim": HEAD_DIM, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
            "max_position_embeddings": 2048}


DEFAULT_DIMS: dict[str, Any] = shape_dims()


def resolve_dims(layers: int | None = None, hidden_size: int | None = None,
                 dims: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every model dim: shape_dims(layers, hidden_size) (each defaulting to `dims`' own value, then to
    the default shape), overridden by `dims` (tests pin toy dims that way)."""
    dims = dict(dims or {})
    unknown = set(dims) - set(DEFAULT_DIMS)
    if unknown:
        raise ConfigError(f"unknown model dims {sorted(unknown)}; choose from {sorted(DEFAULT_DIMS)}")
    for arg, key, val in (("layers", "num_hidden_layers", layers),
                          ("hidden_size", "hidden_size", hidden_size)):
        if val is not None and key in dims and dims[key] != val:
            raise ConfigError(f"{arg}={val} contradicts dims[{key!r}]={dims[key]}")
    L = layers if layers is not None else dims.get("num_hidden_layers", DEFAULT_LAYERS)
    h = hidden_size if hidden_size is not None else dims.get("hidden_size", DEFAULT_HIDDEN)
    return {**shape_dims(L, h), **dims}


def model_config(vocab_size: int, dims: dict[str, Any] | None = None) -> ModelConfig:
    """The splash ModelConfig of the trained model: `resolve_dims(dims=dims)` (the default shape, or the
    shape following from dims' layers and hidden size, overridden by `dims`)."""
    d = resolve_dims(dims=dims)
    return ModelConfig(name="mtp", model_type="deepseek_v3", vocab_size=vocab_size, topk_method="noaux_tc",
                       scoring_func="sigmoid", norm_topk_prob=True, rope_theta=10000.0, rope_scaling=None,
                       rope_interleave=True, bos_token_id=0, eos_token_id=1, pad_token_id=2, **d)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json: splash's built-in form (splash.model.tiny.hf_config_dict) plus one MTP layer."""
    from splash.model.tiny import hf_config_dict

    return {**hf_config_dict(cfg), "num_nextn_predict_layers": 1}


class MTPLayer(nn.Module):
    """DeepSeek-V3's MTP module at depth 1: a DeepseekV3DecoderLayer (layer index L, so its MLP is MoE)
    plus enorm / hnorm / eh_proj / shared_head.norm; the embedding and head are passed in (the main
    model's). Its names, `layer.` dropped, are the checkpoint's under `model.layers.{L}.`."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        d = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], mask: Any,
                head: nn.Module) -> torch.Tensor:
        """Logits for t[i+2] from embed(t[i+1]) and the main model's post-norm hidden h[i]."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x = self.layer(x, attention_mask=mask, position_ids=position_ids,
                       position_embeddings=position_embeddings)
        return head(self.shared_head.norm(x))


class MTPModel(nn.Module):
    """transformers' DeepseekV3ForCausalLM (`main`) plus one MTP layer sharing its embedding and head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        hf = DeepseekV3Config(**{k: v for k, v in hf_config(cfg).items() if k != "architectures"})
        hf._attn_implementation = "sdpa"
        self.main = DeepseekV3ForCausalLM(hf)
        self.mtp = MTPLayer(hf, layer_idx=cfg.num_hidden_layers)
        for m in self.mtp.modules():  # transformers' own init (N(0, initializer_range), unit norms)
            self.main._init_weights(m)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] -> (main logits [B, S, V] for t[1..S], MTP logits [B, S-1, V] for t[2..S])."""
        from transformers.masking_utils import create_causal_mask

        base = self.main.model
        h = base(input_ids=ids).last_hidden_state  # after model.norm
        logits = self.main.lm_head(h)
        n = ids.shape[1] - 1
        pos = torch.arange(n, device=ids.device).unsqueeze(0)
        e = base.embed_tokens(ids[:, 1:])
        rope = base.rotary_emb(e, pos)
        mask = create_causal_mask(config=self.main.config, inputs_embeds=e, attention_mask=None, cache=None,
                                  position_ids=pos)
        mtp_logits = self.mtp(e, h[:, :-1], pos, rope, mask, self.main.lm_head)
        return logits, mtp_logits
