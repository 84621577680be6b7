"""The DeepSeek-V2/V3 (and Kimi-K2, Kimi-Linear) causal LM over rows of a step, attention delegated to a
layout. A hybrid (Kimi-Linear) has MLA layers (NoPE: no rotary when `cfg.use_rope` is False) and KDA
layers (splash/model/kda.py, per `cfg.layer_kind(i)`), the latter through `layout.linear_attention`.

`forward` returns the residual stream *before* the final norm; `compute_logits` applies the norm and
the LM head to just the rows that are sampled, which saves the [N, V] product for prefill rows.

Parallelism outside attention is fixed on T ranks (it never changes with the attention layout, so a
layout switch moves no MLP weights): dense MLP and shared experts tensor-parallel, routed experts
expert-parallel (tensor-parallel when T does not divide E), input embedding vocab-parallel; each
layer's MLP/MoE partials take one all-reduce, tagged "mlp.<layer>" so that CommStats keeps them
apart from the layout's own traffic (tagged with the bare layer index).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splash.core.model_config import ConfigError, ModelConfig, head_slice
from splash.model import gemm
from splash.model.context import ForwardContext
from splash.model.indexer import Indexer
from splash.model.kda import KDA
from splash.model.layers import MLP, RMSNorm, check_activation
from splash.model.loader import CheckpointReader, RenamedReader
from splash.model.mla import MLA
from splash.model.moe import MoE
from splash.model.mtp import MTPLayer
from splash.model.rope import Rotary
from splash.model.shard import even_range, span


def held_heads(cfg: ModelConfig, rank: int, world: int, sharded: bool) -> range:
    """Heads a rank holds: all of them, or its contiguous 1/T slice when projections are sharded."""
    h = cfg.num_attention_heads
    if not sharded or world == 1:
        return range(h)
    cfg.check_ranks(world)
    return head_slice(h, rank, world)


def held_kda_heads(cfg: ModelConfig, rank: int, world: int, sharded: bool) -> range:
    """KDA heads a rank holds: sharded like MLA's heads (head-sharded projections), else all."""
    h = cfg.linear_num_heads
    if not sharded or world == 1:
        return range(h)
    cfg.check_ranks(world)
    return head_slice(h, rank, world)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: Rotary, heads: range, dtype: torch.dtype,
                 device: torch.device | str | None, rank: int = 0, world: int = 1,
                 expert_parallel: str = "auto", kda_heads: range | None = None) -> None:
        super().__init__()
        self.idx = idx
        self.mlp_tag = f"mlp.{idx}"
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.kind = cfg.layer_kind(idx)  # "mla" or "kda"
        self.self_attn: MLA | KDA
        if self.kind == "kda":
            self.self_attn = KDA(cfg, idx, range(cfg.linear_num_heads) if kda_heads is None else kda_heads,
                                 dtype, device)
        else:
            self.self_attn = MLA(cfg, rotary, heads, dtype, device)
        # DSA: "full" layers run an indexer, "shared" ones reuse the previous full layer's top-k
        self.indexer_type = cfg.indexer_type(idx)
        self.indexer = Indexer(cfg, rotary, dtype, device) if self.indexer_type == "full" else None
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.is_moe = cfg.is_moe_layer(idx)
        self.mlp: MoE | MLP
        if self.is_moe:
            self.mlp = MoE(cfg, dtype, device, rank, world, expert_parallel)
        else:
            inter = cfg.intermediate_size
            self.mlp = MLP(d, inter, dtype, device, cols=even_range(inter, rank, world))
        self.mlp_partial = world > 1  # every rank joins the reduce, whatever its slice's size

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        self.input_layernorm.load(reader, f"{prefix}.input_layernorm.weight", dev)
        self.post_attention_layernorm.load(reader, f"{prefix}.post_attention_layernorm.weight", dev)
        self.self_attn.load(reader, f"{prefix}.self_attn", dev)
        if self.indexer is not None:
            self.indexer.load(reader, f"{prefix}.self_attn.indexer", dev)
        self.mlp.load(reader, f"{prefix}.mlp", dev)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        m = self._modules  # direct, as in MLA: no hooks here, and the nn.Module machinery is not free
        attn = m["self_attn"]
        xn = m["input_layernorm"].forward(x)
        if self.kind == "kda":
            x = x + ctx.layout.linear_attention(self.idx, attn, xn, ctx)
            return self._mlp(x, ctx)
        q_in, latent_new = attn.prepare(xn, ctx.positions)
        if ctx.sparse is not None:  # DSA: this layer's index rows (None: shared) before its attention
            ix = m.get("indexer")
            rows = None if ix is None else ix.prepare(xn, q_in, ctx.positions,
                                                      ctx.layout.index_rows(attn, ctx))
            ctx.sparse.begin(self.idx, rows, ctx)
        x = x + ctx.layout.attention(self.idx, attn, q_in, latent_new, ctx)
        return self._mlp(x, ctx)

    def _mlp(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        m = self._modules
        h = m["mlp"].forward(m["post_attention_layernorm"].forward(x))
        if self.mlp_partial:
            h = ctx.comm.all_reduce(h, tag=self.mlp_tag)
        return x + h


class DeepseekForCausalLM(nn.Module):
    """One rank's share of the model.

    `attn_sharded`: hold a 1/world slice of the attention heads' projections (TP/DOP) rather than all
    of them (DP/CP). Outside attention the split is fixed: dense MLP and shared experts hold a 1/world
    slice of their intermediate size, routed experts a contiguous block of E/world experts
    (`expert_parallel` "auto"/"ep"; "tp" or a world not dividing E: a slice of every expert's
    intermediate size instead), and the input embedding a contiguous 1/world of the vocabulary rows
    (looked up where held, zero elsewhere, summed by one all-reduce per step).

    The LM head is replicated by default, so `compute_logits` stays local to the rank that samples
    (rank 0) and costs no collective; it is small next to the experts for DeepSeek models (~2% of
    V3). `shard_lm_head=True` splits it by vocabulary rows too; `compute_logits(rows, comm)` then is
    a collective every rank must call with the same rows (an all-gather of the [n, V/T] pieces).
    Tied embeddings are sharded only together with the head (they are the same matrix).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, rank: int = 0, world: int = 1,
                 attn_sharded: bool = True, device: torch.device | str | None = None, *,
                 expert_parallel: str = "auto", shard_lm_head: bool = False) -> None:
        super().__init__()
        check_activation(cfg.hidden_act)
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is outside a world of {world}")
        self.cfg, self.dtype, self.rank, self.world = cfg, dtype, rank, world
        self.device = torch.device(device or "cpu")
        self.attn_sharded = attn_sharded and world > 1
        self.rotary = Rotary(cfg, None if self.device.type == "meta" else self.device)
        heads = held_heads(cfg, rank, world, attn_sharded)
        kda_heads = held_kda_heads(cfg, rank, world, attn_sharded) if cfg.is_hybrid else None
        d, v = cfg.hidden_size, cfg.vocab_size
        self.vocab_size = v
        shard_head = shard_lm_head and world > 1
        shard_embed = world > 1 and (shard_head or not cfg.tie_word_embeddings)
        self.embed_sharded, self.head_sharded = shard_embed, shard_head  # same on every rank
        self.embed_rows = even_range(v, rank, world) if shard_embed else range(v)
        self.head_rows = even_range(v, rank, world) if shard_head else range(v)
        self.register_buffer("embed", torch.empty(len(self.embed_rows), d, dtype=dtype, device=self.device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, heads, dtype, self.device, rank, world,
                                                 expert_parallel, kda_heads)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, self.device)
        # the served MTP layers (cfg.draft_layers: speculative decoding with MTP on), else none
        self.mtp = nn.ModuleList(
            MTPLayer(DecoderLayer(cfg, i, self.rotary, heads, dtype, self.device, rank, world,
                                  expert_parallel, kda_heads), d, v, cfg.rms_norm_eps, dtype, self.device)
            for i in cfg.mtp_layers)
        self.register_buffer("lm_head", None if cfg.tie_word_embeddings
                             else torch.empty(len(self.head_rows), d, dtype=dtype, device=self.device))

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, reader: CheckpointReader) -> None:
        dt, dev = self.dtype, self.device
        expect = [self.cfg.vocab_size, self.cfg.hidden_size]
        if reader.shape("model.embed_tokens.weight") != expect:
            raise ConfigError(f"embed_tokens has shape {tuple(reader.shape('model.embed_tokens.weight'))}, "
                              f"config says {tuple(expect)}")
        self.embed = reader.get("model.embed_tokens.weight", dt, dev, rows=span(self.embed_rows, expect[0]))
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}", dev)
        for m in self.mtp:
            name = f"model.layers.{m.idx}.eh_proj.weight"
            if not reader.has(name):
                raise ConfigError(f"the checkpoint has no MTP layer {m.idx} ({name} is missing): use "
                                  "--speculative-algorithm NGRAM, or a checkpoint with its MTP layers")
            m.load(reader, f"model.layers.{m.idx}", dev)
        self.norm.load(reader, "model.norm.weight", dev)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = reader.get("lm_head.weight", dt, dev, rows=span(self.head_rows, expect[0]))
        self.fuse()

    def fuse(self) -> None:
        """Weights that share an input run as one GEMM where that is bit-identical (CPU, float32/bf16):
        q_a with kv_a, gate with up (dense MLP, shared experts). Views keep every weight's name."""
        for layer in self.attn_layers():
            layer.self_attn.fuse()
            mlp = layer.mlp
            if isinstance(mlp, MLP):
                mlp.fuse()
            elif mlp.shared is not None:
                mlp.shared.fuse()

    def attn_layers(self) -> list[DecoderLayer]:
        """Every decoder block whose attention a layout places: the model's, then the served MTP layers'
        (layer ids 0 .. cfg.num_attn_layers - 1, in order)."""
        return [*self.layers, *(m.block for m in self.mtp)]

    def layer(self, idx: int) -> DecoderLayer:
        """The decoder block of checkpoint layer `idx` (an MTP layer's block past the last)."""
        n = len(self.layers)
        return self.layers[idx] if idx < n else self.mtp[idx - n].block

    def weight_counts(self) -> dict[str, int]:
        """Elements this rank holds per part: attention, mlp (dense), experts (routed), shared,
        router, embed, lm_head, norms. What the fixed parallelism splits is mlp/experts/shared/embed."""
        parts = ("attention", "indexer", "mlp", "experts", "shared", "router", "embed", "lm_head", "norms",
                 "mtp")
        out = dict.fromkeys(parts, 0)
        for name, b in self.named_buffers():
            if b is None or name.startswith("rotary."):
                continue
            if name.startswith("mtp.") and not name.split(".", 3)[2] == "block":
                part = "mtp"  # the MTP layers' own tensors (their blocks count as layers do)
            elif name.endswith("layernorm.weight") or name == "norm.weight":
                part = "norms"
            elif ".indexer." in name:
                part = "indexer"
            elif ".self_attn." in name:
                part = "attention"
            elif ".mlp.gate." in name:
                part = "router"
            elif ".mlp.shared." in name:
                part = "shared"
            elif ".mlp." in name:
                part = "experts" if name.endswith(("mlp.gate_up", "mlp.down")) else "mlp"
            elif name in ("embed", "lm_head"):
                part = name
            else:
                raise AssertionError(f"unclassified weight {name}")
            out[part] += b.numel()
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, rank: int = 0,
                        world: int = 1, attn_sharded: bool = True, device: torch.device | str | None = None,
                        cfg: ModelConfig | None = None, *, expert_parallel: str = "auto",
                        shard_lm_head: bool = False) -> DeepseekForCausalLM:
        """Build this rank's share and read only its slices from the checkpoint."""
        cfg = cfg or ModelConfig.from_hf(path)
        # weights are replaced tensor by tensor on load, so build the skeleton on the meta device
        model = cls(cfg, dtype, rank, world, attn_sharded, device="meta", expert_parallel=expert_parallel,
                    shard_lm_head=shard_lm_head)
        model.device = torch.device(device or "cpu")
        model.rotary.to(model.device)
        reader: Any = CheckpointReader(path, cfg.quantization_config)
        if cfg.model_type == "kimi_linear":  # Kimi's MoE names (block_sparse_moe, experts' w1/w2/w3)
            reader = RenamedReader(reader, cfg.model_type)
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
        if self.cfg.is_hybrid and ctx.state is None:
            raise RuntimeError("a KDA hybrid's step needs its requests' state slots: build the "
                               "ForwardContext with state=<the rank's StatePool>")
        if self.cfg.is_sparse and ctx.sparse is None:
            ctx.sparse = ctx.layout.sparse_step(self.cfg.index_topk, ctx)
        x = self.embed_tokens(input_ids, ctx)
        # the step's rotary rows, looked up once and memoised for every layer (no device sync: the
        # plan gives the bound)
        self.rotary.tables(ctx.positions, bound=ctx.max_end or None)
        for layer in self.layers:
            x = layer.forward(x, ctx)
        return x

    @torch.inference_mode()
    def draft_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                      depth: int = 0) -> torch.Tensor:
        """MTP layer `depth` over the rows of `ctx`: [N] next tokens, [N, d] normed hidden states (the
        target's after the final norm, or a draft row's `draft_head` output) -> [N, d] its output."""
        if self.cfg.is_sparse and ctx.sparse is None:
            ctx.sparse = ctx.layout.sparse_step(self.cfg.index_topk, ctx)
        self.rotary.tables(ctx.positions, bound=ctx.max_end or None)
        return self.mtp[depth](self.embed_tokens(next_ids, ctx), hidden, ctx)

    @torch.inference_mode()
    def draft_extend(self, next_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                     depth: int = 0, whole: bool = False) -> torch.Tensor:
        """MTP layer `depth`'s draft KV of the rows of `ctx` written (no attention, no MoE: see
        MTPLayer.write_kv) -> [N, d] their block inputs, for the rows a chain starts from. `whole`: the
        whole block over every row instead (which writes the same KV) -> [N, d] its outputs: where the
        rows are few, one block over all of them costs less than the KV alone plus a block over the
        chain rows (`draft_block`), the per-op cost being most of both."""
        self.rotary.tables(ctx.positions, bound=ctx.max_end or None)
        m = self.mtp[depth]
        x = m.mix(self.embed_tokens(next_ids, ctx), hidden)
        if whole:
            return self._draft_block(x, ctx, depth)
        m.write_kv(x, ctx)
        return x

    @torch.inference_mode()
    def draft_block(self, x: torch.Tensor, ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """MTP layer `depth`'s decoder block over block-input rows `x` (from `draft_extend`)."""
        self.rotary.tables(ctx.positions, bound=ctx.max_end or None)
        return self._draft_block(x, ctx, depth)

    def _draft_block(self, x: torch.Tensor, ctx: ForwardContext, depth: int) -> torch.Tensor:
        """The block itself, the rotary tables of `ctx` made (a DSA model's sparse step begun here)."""
        if self.cfg.is_sparse and ctx.sparse is None:
            ctx.sparse = ctx.layout.sparse_step(self.cfg.index_topk, ctx)
        return self.mtp[depth].block.forward(x, ctx)

    @torch.inference_mode()
    def draft_head(self, x: torch.Tensor, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed rows, logits) of MTP layer `depth`'s output rows: the logits give its drafts, the
        normed rows are the hidden state the next draft of a chain reads."""
        m = self.mtp[depth]
        h = m.head_norm(x)
        head = m.head if m.head is not None else (self.embed if self.lm_head is None else self.lm_head)
        if m.head is None and self.head_sharded:
            raise ConfigError("an MTP layer without its own shared_head needs a replicated LM head "
                              "(drop shard_lm_head)")
        return h, gemm.linear(h, head)

    def embed_tokens(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """[N] -> [N, d]; vocab-parallel: held rows looked up, others zero, then summed over ranks
        (exact: every row has exactly one non-zero term)."""
        if not self.embed_sharded:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.embed_rows.start
        miss = (local < 0) | (local >= len(self.embed_rows))
        x = F.embedding(local.masked_fill(miss, 0), self.embed).masked_fill_(miss[:, None], 0.0)
        return ctx.comm.all_reduce(x, tag="embed")

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor, comm: Any = None) -> torch.Tensor:
        """[n, d] rows from `forward` -> [n, V] logits (final norm + LM head). With a vocab-parallel
        head (`shard_lm_head`), every rank calls this with the same rows and `comm`; all get [n, V]."""
        head = self.embed if self.lm_head is None else self.lm_head
        h = self.norm(hidden_rows)
        if not self.head_sharded:
            return gemm.linear(h, head)
        if comm is None:
            raise RuntimeError("this model's LM head is vocab-parallel (shard_lm_head=True): every rank "
                               "must call compute_logits(rows, comm) with the same rows")
        sizes = [len(even_range(self.vocab_size, r, self.world)) for r in range(self.world)]
        part = gemm.linear(h, head)
        if part.shape[1] < sizes[0]:  # equal-shape gather: pad the shorter slices by a column
            part = F.pad(part, (0, sizes[0] - part.shape[1]))
        pieces = comm.all_gather(part.contiguous(), tag="lm_head")  # [T, n, ceil(V/T)]
        return torch.cat([pieces[r, :, :sizes[r]] for r in range(self.world)], dim=1)
