"""The DeepSeek-V2/V3 (and Kimi-K2) causal LM over rows of a step, attention delegated to a layout.

`forward` returns the residual stream *before* the final norm; `compute_logits` applies the norm and
the LM head to just the rows that are sampled, which saves the [N, V] product for prefill rows.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from splash.config import ConfigError, ModelConfig
from splash.model.context import ForwardContext
from splash.model.layers import MLP, RMSNorm, check_activation
from splash.model.loader import CheckpointReader
from splash.model.mla import MLA
from splash.model.moe import MoE
from splash.model.rope import Rotary


def held_heads(cfg: ModelConfig, rank: int, world: int, sharded: bool) -> range:
    """Heads a rank holds: all of them, or its contiguous 1/T slice when projections are sharded."""
    h = cfg.num_attention_heads
    if not sharded or world == 1:
        return range(h)
    cfg.check_ranks(world)
    per = h // world
    return range(rank * per, (rank + 1) * per)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: Rotary, heads: range, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.idx = idx
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MLA(cfg, rotary, heads, dtype, device)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.is_moe = cfg.is_moe_layer(idx)
        self.mlp: nn.Module = MoE(cfg, dtype, device) if self.is_moe else MLP(d, cfg.intermediate_size, dtype,
                                                                             device)

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        self.input_layernorm.load(reader, f"{prefix}.input_layernorm.weight", dev)
        self.post_attention_layernorm.load(reader, f"{prefix}.post_attention_layernorm.weight", dev)
        self.self_attn.load(reader, f"{prefix}.self_attn", dev)
        self.mlp.load(reader, f"{prefix}.mlp", dev)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_in, latent_new = self.self_attn.prepare(self.input_layernorm(x), ctx.positions)
        x = x + ctx.layout.attention(self.idx, self.self_attn, q_in, latent_new, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekForCausalLM(nn.Module):
    """One rank's share of the model. `attn_sharded`: hold a 1/world slice of the attention heads'
    projections (TP/DOP) rather than all of them (DP/CP); MLP, MoE and embeddings are replicated."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, rank: int = 0, world: int = 1,
                 attn_sharded: bool = True, device: torch.device | str | None = None) -> None:
        super().__init__()
        check_activation(cfg.hidden_act)
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is outside a world of {world}")
        self.cfg, self.dtype, self.rank, self.world = cfg, dtype, rank, world
        self.device = torch.device(device or "cpu")
        self.attn_sharded = attn_sharded and world > 1
        self.rotary = Rotary(cfg, None if self.device.type == "meta" else self.device)
        heads = held_heads(cfg, rank, world, attn_sharded)
        d, v = cfg.hidden_size, cfg.vocab_size
        self.register_buffer("embed", torch.empty(v, d, dtype=dtype, device=self.device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, heads, dtype, self.device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, self.device)
        self.register_buffer("lm_head", None if cfg.tie_word_embeddings
                             else torch.empty(v, d, dtype=dtype, device=self.device))

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, reader: CheckpointReader) -> None:
        dt, dev = self.dtype, self.device
        self.embed = reader.get("model.embed_tokens.weight", dt, dev)
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}", dev)
        self.norm.load(reader, "model.norm.weight", dev)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = reader.get("lm_head.weight", dt, dev)
        expect = (self.cfg.vocab_size, self.cfg.hidden_size)
        if tuple(self.embed.shape) != expect:
            raise ConfigError(f"embed_tokens has shape {tuple(self.embed.shape)}, config says {expect}")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, rank: int = 0,
                        world: int = 1, attn_sharded: bool = True, device: torch.device | str | None = None,
                        cfg: ModelConfig | None = None) -> DeepseekForCausalLM:
        cfg = cfg or ModelConfig.from_hf(path)
        # weights are replaced tensor by tensor on load, so build the skeleton on the meta device
        model = cls(cfg, dtype, rank, world, attn_sharded, device="meta")
        model.device = torch.device(device or "cpu")
        model.rotary.to(model.device)
        reader = CheckpointReader(path, cfg.quantization_config)
        try:
            model.load_weights(reader)
        finally:
            reader.close()
        leftover = [n for n, b in model.named_buffers() if b.is_meta]
        if leftover:
            raise ConfigError(f"checkpoint {path!r} did not provide: {', '.join(leftover[:5])}")
        return model

    # ---- compute --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [N] -> residual stream [N, d] after the last layer (pre final norm)."""
        x = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            x = layer(x, ctx)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[n, d] rows from `forward` -> [n, V] logits (final norm + LM head)."""
        head = self.embed if self.lm_head is None else self.lm_head
        return F.linear(self.norm(hidden_rows), head)
