"""Byte sizes of the state a layout switch can move: head-sliced projections (Eq 9) and latent KV.

Appendix A counts, per MLA layer, the projections that TP/DOP shard by heads (Q-B, KV-B, O); Q-A,
KV-A, rotary-key rows and norms stay replicated and never move. Byte counts are exact functions of
a head *set*, so a manifest can price any slice, including FP8 128x128 block scales when asked.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from splash.core.config import ConfigError, ModelConfig, dtype_bytes, head_slice, normalize_dtype

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
FP8_SCALE_BYTES = 4  # DeepSeek-V3 FP8 checkpoints store one fp32 `weight_scale_inv` per block


def head_runs(heads: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted head ids -> maximal contiguous half-open runs [(start, stop), ...]."""
    runs: list[tuple[int, int]] = []
    for h in sorted(set(heads)):
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1)
        else:
            runs.append((h, h + 1))
    return runs


@dataclass(frozen=True)
class Projection:
    """One head-sharded projection: a [out, in] weight whose head axis is `rows` or `cols`."""

    name: str
    per_head: int  # width one head occupies along the head axis
    other: int  # the full extent of the other axis
    head_axis: str  # "rows" (q_b, kv_b: output features) or "cols" (o: input features)
    heads: int

    @property
    def numel(self) -> int:
        return self.per_head * self.heads * self.other

    def slice_bytes(self, heads: Iterable[int], dtype: str, fp8_scales: bool = False,
                    block: int = 128) -> float:
        """Bytes of the weight rows/cols of `heads`, plus the FP8 block scales they need."""
        runs = head_runs(heads)
        n = sum(b - a for a, b in runs)
        total = n * self.per_head * self.other * dtype_bytes(dtype)
        if fp8_scales and normalize_dtype(dtype) == "fp8":
            other_blocks = -(-self.other // block)
            for a, b in runs:
                lo, hi = a * self.per_head, b * self.per_head
                total += ((hi - 1) // block - lo // block + 1) * other_blocks * FP8_SCALE_BYTES
        return total


def projections(cfg: ModelConfig) -> tuple[Projection, ...]:
    """The projections TP/DOP shard by heads, per layer (`q` replaces `q_b` without q_lora_rank)."""
    H = cfg.num_attention_heads
    q_in = cfg.q_lora_rank if cfg.q_lora_rank else cfg.hidden_size
    return (
        Projection("q_b" if cfg.q_lora_rank else "q", cfg.qk_head_dim, q_in, "rows", H),
        Projection("kv_b", cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank, "rows", H),
        Projection("o", cfg.v_head_dim, cfg.hidden_size, "cols", H),
    )


def fp8_block(cfg: ModelConfig) -> int:
    """FP8 scale block edge: from the checkpoint's quantization_config, else DeepSeek-V3's 128."""
    q = cfg.quantization_config or {}
    size = q.get("weight_block_size") if isinstance(q, dict) else None
    return int(size[0]) if isinstance(size, (list, tuple)) and size else 128


@dataclass(frozen=True)
class AttentionSizes:
    """Everything the ownership model needs in bytes: W_A, k, per-layer projection sizes."""

    cfg: ModelConfig
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    fp8_scales: bool = False
    # Derived byte counts are pure functions of the fields above; the policy asks for them every
    # step, so they are computed once.
    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))

    def memo(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """Cached `fn()` under `key` (callers key by everything the value depends on)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def layers(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads

    @property
    def projections(self) -> tuple[Projection, ...]:
        return projections(self.cfg)

    def slice_bytes(self, proj: Projection, heads: Iterable[int]) -> float:
        return proj.slice_bytes(heads, self.dtype, self.fp8_scales, fp8_block(self.cfg))

    def layer_weight_bytes(self) -> dict[str, float]:
        """Eq 9 per layer: each projection's full bytes (scales included if asked) and the total."""
        def compute() -> dict[str, float]:
            allh = range(self.heads)
            out = {p.name: self.slice_bytes(p, allh) for p in self.projections}
            out["total"] = sum(out.values())
            return out
        return dict(self.memo("layer_weight_bytes", compute))

    @property
    def w_layer(self) -> float:
        """S_A: one layer's shardable projection bytes."""
        return self.memo("w_layer", lambda: self.layer_weight_bytes()["total"])

    @property
    def w_a(self) -> float:
        """W_A: shardable projection bytes over all layers (the quantity of Eq 1)."""
        return self.w_layer * self.layers

    @property
    def kv_token_layer(self) -> float:
        """Latent bytes of one token in one layer: (d_c + d_r) * b_kv (absorbed MLA)."""
        return self.cfg.latent_dim * dtype_bytes(self.kv_dtype)

    @property
    def k(self) -> float:
        """k: KV bytes per context token over all cache-bearing layers, L*(d_c+d_r)*b."""
        return self.kv_token_layer * self.layers

    def replicated_bytes(self) -> float:
        """M0: weights every rank holds whatever the attention layout (bytes per rank).

        Q-A/KV-A and norms are replicated; dense MLP, experts and the vocabulary are assumed
        sharded 1/T by the fixed non-attention parallelism, so callers divide `sharded_bytes`.
        """
        c = self.cfg
        b = dtype_bytes(self.dtype)
        qa = c.hidden_size * c.q_lora_rank + c.q_lora_rank if c.q_lora_rank else 0
        kva = c.hidden_size * c.latent_dim + c.kv_lora_rank
        norms = 2 * c.hidden_size
        return self.layers * ((qa + kva) * b + norms * 2) + c.hidden_size * 2

    def expert_bytes(self) -> float:
        """Routed-expert weights over all layers (read only for the experts a batch touches)."""
        c = self.cfg
        n = sum(1 for i in range(self.layers) if c.is_moe_layer(i))
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size * dtype_bytes(self.dtype)
        return n * (c.n_routed_experts or 0) * per_expert

    def sharded_bytes(self) -> float:
        """Non-attention weights that the fixed MLP/MoE/vocab parallelism splits over ranks."""
        c = self.cfg
        b = dtype_bytes(self.dtype)
        vocab = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        mlp = 0
        for i in range(self.layers):
            if c.is_moe_layer(i):
                experts = (c.n_routed_experts or 0) + (c.n_shared_experts or 0)
                mlp += experts * 3 * c.hidden_size * c.moe_intermediate_size
                mlp += (c.n_routed_experts or 0) * c.hidden_size  # router stays small; count it here
            else:
                mlp += 3 * c.hidden_size * c.intermediate_size
        return (vocab + mlp) * b

    def fixed_bytes_per_rank(self, ranks: int) -> float:
        """M0_r of Eq 6: the non-attention, layout-independent weights on one rank."""
        if ranks < 1:
            raise ConfigError(f"ranks must be >= 1, got {ranks}")
        return self.memo(("fixed", ranks), lambda: self.replicated_bytes() + self.sharded_bytes() / ranks)

    def attention_weight_bytes(self, sharded: bool, ranks: int, rank: int = 0) -> float:
        """W_r(l): rank `rank`'s head slice of every layer (W_A/T) when sharded, else W_A."""
        if not sharded:
            return self.w_a
        mine = head_slice(self.heads, rank, ranks)
        return self.memo(("w_rank", ranks, rank),
                         lambda: self.layers * sum(self.slice_bytes(p, mine) for p in self.projections))
