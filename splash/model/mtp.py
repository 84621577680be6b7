"""A multi-token-prediction (MTP) layer of DeepSeek-V3/V3.2 and GLM-5: the draft model of speculative
decoding with the checkpoint's own weights (transformers ignores these layers; splash loads them).

Layer `num_hidden_layers + i` of the checkpoint holds `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,
head}` and a whole decoder layer (MLA attention with its own KV, its own MoE, a DSA indexer where the
model has one). At position i it reads the target's hidden state there (after the final norm) and the
*next* token's embedding, and its head predicts the token after that (SGLang's and vLLM's convention):

    x = eh_proj([enorm(embed(t[i+1])); hnorm(h[i])]);  x = block(x, position i);  logits = head(norm(x))

A chain of k drafts feeds the layer's own normed output back as `h` (SGLang's topk 1). The decoder block
is the model's own `DecoderLayer` (passed in, so this file imports no model), placed by the layout like
every layer: its KV is the `mtp_latent` store (splash.core.stores) and it switches with the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splash.model import gemm
from splash.model.layers import RMSNorm
from splash.model.loader import CheckpointReader


class MTPLayer(nn.Module):
    def __init__(self, block: nn.Module, hidden: int, vocab: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.idx = block.idx
        self.block = block
        self.enorm = RMSNorm(hidden, eps, dtype, device)
        self.hnorm = RMSNorm(hidden, eps, dtype, device)
        self.head_norm = RMSNorm(hidden, eps, dtype, device)
        self.register_buffer("eh_proj", torch.empty(hidden, 2 * hidden, dtype=dtype, device=device))
        # the checkpoint's shared_head.head (a copy of lm_head in DeepSeek-V3's), replicated on every rank
        # so each rank's argmax gives the same drafts without a collective; None: the model's own head
        self.register_buffer("head", torch.empty(vocab, hidden, dtype=dtype, device=device))

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        self.block.load(reader, prefix, dev)
        self.enorm.load(reader, f"{prefix}.enorm.weight", dev)
        self.hnorm.load(reader, f"{prefix}.hnorm.weight", dev)
        self.head_norm.load(reader, f"{prefix}.shared_head.norm.weight", dev)
        self.eh_proj = reader.get(f"{prefix}.eh_proj.weight", self.eh_proj.dtype, dev)
        name = f"{prefix}.shared_head.head.weight"
        self.head = reader.get(name, self.eh_proj.dtype, dev) if reader.has(name) else None

    def mix(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[N, d] next tokens' embeddings and [N, d] normed hidden states -> [N, d] the block's input."""
        return gemm.linear(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1), self.eh_proj)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        """[N, d] next tokens' embeddings and [N, d] normed hidden states -> [N, d] the block's output."""
        return self.block.forward(self.mix(embedded, hidden), ctx)

    def write_kv(self, x: torch.Tensor, ctx: Any) -> None:
        """Store the draft KV of block-input rows `x` (the latent, and a DSA indexer's keys) where the
        layout places them, without attending: a row's keys depend only on its own input, and rows that
        draft nothing need no more (the extend over accepted rows is this, plus full rows where chains
        start)."""
        b = self.block
        xn = b.input_layernorm(x)
        q_in, latent = b.self_attn.prepare(xn, ctx.positions)
        ctx.layout.write_kv(b.idx, latent, ctx)
        if b.indexer is not None and ctx.kv is not None and ctx.write_slots is not None:
            k_new = b.indexer.prepare(xn, q_in, ctx.positions).k_new
            held = k_new if ctx.all_held else k_new[ctx.write_rows]
            ctx.kv.write_store("index_k", b.idx, ctx.write_slots, held)
