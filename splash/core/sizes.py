"""Byte sizes of the state a layout switch can move: head-sliced projections (Eq 9) and per-token KV.

Appendix A counts, per MLA layer, the projections that TP/DOP shard by heads (Q-B, KV-B, O); Q-A,
KV-A, rotary-key rows and norms stay replicated and never move. Byte counts are exact functions of
a head *set*, so a manifest can price any slice, including FP8 128x128 block scales when asked.

KV bytes per token are written once here (`kv_bytes_per_token_layer`, `kv_bytes_per_token`), over the
per-token stores of `splash.core.stores` (the latent, and a DSA model's indexer keys in its indexer
layers): every KV dtype but fp8 takes width x bytes per value; fp8 is the layout the paper counts
(appendix B.1, DeepSeek-V3.2: `(512 + 4*4 + 64*2 + 128 + 4) * 61 = 48,068` bytes per token).
A hybrid's KDA layers (SPEC §10) have head-sliced projections too (`kda_projections`: q, k, v, their
short convs, the forget gate's f_b, dt_bias and A_log, the beta projection b, the output gate's g_b, and
o), which TP/DOP shard over the KDA heads and a switch moves by Eq 9 like MLA's; the low-rank f_a and
g_a and the gated norm stay replicated. They keep no KV: only MLA layers count in k. Their per-request
state (recurrent state in float32 unless the model is float64, conv states in the activation dtype) is
z bytes per request (`AttentionSizes.z`, from `splash.core.stores`).
Pure Python: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from splash.core.model_config import ConfigError, ModelConfig, dtype_bytes, head_slice, normalize_dtype
from splash.core.stores import (
    Store,
    kv_format,
    layer_state_bytes,
    request_state_bytes,
    request_stores,
    store_row_bytes,
    token_stores,
)

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
          "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB', '512MB', '1e9', 123 -> bytes; ConfigError on anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"cannot read memory size {value!r}; write e.g. 2GiB, 512MiB or 1500000000")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
FP8_SCALE_BYTES = 4  # DeepSeek-V3 FP8 checkpoints store one fp32 `weight_scale_inv` per block


def store_token_bytes(cfg: ModelConfig, store: Store, kv_dtype: str) -> float:
    """Bytes one token adds to `store` in one of its layers under KV format `kv_dtype` (the store
    table's element formats, `splash.core.stores.store_parts`): fp8 (= fp8_ds_mla) is the layout the
    paper counts (appendix B.1), DeepSeek's: the latent's d_c in FP8 with a float32 scale per 128 values,
    its rotary key d_r in BF16, the indexer key FP8 with a scale per 128; a plain dtype: width x bytes."""
    return store_row_bytes(cfg, store, kv_dtype)


def kv_bytes_per_token_layer(cfg: ModelConfig, kv_dtype: str, layer: int) -> float:
    """KV bytes one token takes in `layer`: the latent plus, in a DSA indexer layer, its indexer key."""
    return sum(store_token_bytes(cfg, s, kv_dtype) for s in token_stores(cfg) if layer in s.layers)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> float:
    """k of Eq 1: KV bytes one context token takes over every layer and per-token store."""
    return sum(store_token_bytes(cfg, s, kv_dtype) * len(s.layers) for s in token_stores(cfg))


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


def kda_projections(cfg: ModelConfig) -> tuple[Projection, ...]:
    """A KDA layer's head-sliced weights (transformers' KimiLinearDeltaAttention; () unless hybrid):
    every one has the KDA head axis, so TP/DOP hold 1/T of each and Eq 9 moves them like MLA's. The
    conv1d over the concatenated q, k, v channels counts as three per-head slices of d x K."""
    if not cfg.is_hybrid:
        return ()
    H, d, K, hid = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel, cfg.hidden_size
    return (
        Projection("q", d, hid, "rows", H), Projection("k", d, hid, "rows", H),
        Projection("v", d, hid, "rows", H),
        Projection("q_conv", d, K, "rows", H), Projection("k_conv", d, K, "rows", H),
        Projection("v_conv", d, K, "rows", H),
        Projection("f_b", d, d, "rows", H), Projection("dt_bias", d, 1, "rows", H),
        Projection("A_log", 1, 1, "rows", H), Projection("b", 1, hid, "rows", H),
        Projection("g_b", d, d, "rows", H), Projection("o", d, hid, "cols", H),
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
    state_dtype: str | None = None  # a KDA recurrent state's dtype (None: fp32, fp64 for an fp64 model)
    # Derived byte counts are pure functions of the fields above; the policy asks for them every
    # step, so they are computed once.
    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", kv_format(self.kv_dtype))
        if self.state_dtype is not None:
            object.__setattr__(self, "state_dtype", normalize_dtype(self.state_dtype))

    def memo(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """Cached `fn()` under `key` (callers key by everything the value depends on)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def layers(self) -> int:
        """Layers with attention weights and KV: the decoder's and any served MTP layer's."""
        return self.cfg.num_attn_layers

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
        """W_A: shardable projection bytes over all layers (the quantity of Eq 1): MLA's per MLA layer
        and, in a hybrid, KDA's per KDA layer."""
        if not self.cfg.is_hybrid:
            return self.w_layer * self.layers
        return self.w_layer * len(self.mla_layers) + self.w_layer_kda * len(self.kda_layers)

    # -- hybrids (KDA layers) -------------------------------------------------------------------
    @property
    def mla_layers(self) -> tuple[int, ...]:
        return self.cfg.mla_layers + self.cfg.mtp_layers

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.kda_layers or ())

    @property
    def kda_heads(self) -> int:
        return self.cfg.linear_num_heads

    @property
    def kda_projections(self) -> tuple[Projection, ...]:
        return kda_projections(self.cfg)

    def kda_layer_weight_bytes(self) -> dict[str, float]:
        """Eq 9 per KDA layer: each head-sliced weight's full bytes and the total ({} unless hybrid)."""
        def compute() -> dict[str, float]:
            if not self.cfg.is_hybrid:
                return {}
            allh = range(self.kda_heads)
            out = {p.name: self.slice_bytes(p, allh) for p in self.kda_projections}
            out["total"] = sum(out.values())
            return out
        return dict(self.memo("kda_layer_weight_bytes", compute))

    @property
    def w_layer_kda(self) -> float:
        """One KDA layer's shardable weight bytes (0 unless hybrid)."""
        return self.memo("w_layer_kda", lambda: self.kda_layer_weight_bytes().get("total", 0.0))

    def layer_projections(self, layer: int) -> tuple[tuple[Projection, ...], int]:
        """(head-sliced projections, heads) of `layer`: MLA's or, in a KDA layer, KDA's."""
        if self.cfg.layer_kind(layer) == "kda":
            return self.kda_projections, self.kda_heads
        return self.projections, self.heads

    def layer_w(self, layer: int) -> float:
        """S_A of `layer`: its shardable projection bytes (MLA's or KDA's)."""
        return self.w_layer_kda if self.cfg.layer_kind(layer) == "kda" else self.w_layer

    @property
    def z(self) -> float:
        """z: per-request state bytes over every KDA layer (0 for a pure MLA model)."""
        return self.memo("z", lambda: request_state_bytes(self.cfg, self.dtype, self.state_dtype))

    @property
    def state_layer_bytes(self) -> float:
        """One request's state in one KDA layer, all heads (recurrent + conv)."""
        return self.memo("z_layer", lambda: layer_state_bytes(self.cfg, self.dtype, self.state_dtype)
                         if self.cfg.is_hybrid else 0.0)

    @property
    def state_head_bytes(self) -> float:
        """One request's state of one KDA head in one layer: the block a switch moves."""
        return self.state_layer_bytes / self.kda_heads if self.cfg.is_hybrid else 0.0

    def state_store_bytes(self) -> dict[str, float]:
        """Per request and KDA layer, each per-request store's bytes ({"kda_state": ..., "kda_conv": ...})."""
        from splash.core.stores import store_request_bytes
        return {st.name: store_request_bytes(st, self.dtype, self.state_dtype)
                for st in request_stores(self.cfg)}

    @property
    def kda_replicated_layer_bytes(self) -> float:
        """A KDA layer's weights no head owns: f_a [d, hidden], g_a [d, hidden] and the gated norm [d],
        replicated on every rank in every layout (never moved)."""
        c = self.cfg
        if not c.is_hybrid:
            return 0.0
        d = c.linear_head_dim
        return 2 * self._matrix_bytes(d, c.hidden_size) + d * 2

    @property
    def kv_layer_bytes(self) -> tuple[float, ...]:
        """KV bytes of one token in each layer (`kv_bytes_per_token_layer`): a DSA indexer layer adds its
        indexer key to the latent; GLM-5's shared layers hold the latent only."""
        return self.memo("kv_layer_bytes", lambda: tuple(
            kv_bytes_per_token_layer(self.cfg, self.kv_dtype, i) for i in range(self.layers)))

    def kv_token_bytes(self, layer: int) -> float:
        """KV bytes of one token in `layer`."""
        return self.kv_layer_bytes[layer]

    def store_bytes(self, name: str) -> float:
        """Bytes one token adds to per-token store `name` ("latent", "index_k") in a layer that has it
        (0 where the model has no such store): what each attention stage reads per key."""
        def compute() -> float:
            found = [st for st in token_stores(self.cfg) if st.name == name]
            return store_token_bytes(self.cfg, found[0], self.kv_dtype) if found else 0.0
        return self.memo(("store", name), compute)

    @property
    def kv_token_layer(self) -> float:
        """KV bytes of one token in the largest layer ((d_c + d_r) * b_kv in absorbed MLA, + the indexer
        key in DSA): what one layer in transit (Eq 5) moves per token at most."""
        return max(self.kv_layer_bytes, default=0.0)

    @property
    def k(self) -> float:
        """k: KV bytes per context token over all cache-bearing layers (`kv_bytes_per_token`)."""
        return self.memo("k", lambda: kv_bytes_per_token(self.cfg, self.kv_dtype))

    def _matrix_bytes(self, rows: int, cols: int) -> float:
        """A replicated [rows, cols] weight in the weight dtype, with its FP8 block scales if counted."""
        total = rows * cols * dtype_bytes(self.dtype)
        if self.fp8_scales and self.dtype == "fp8":
            b = fp8_block(self.cfg)
            total += -(-rows // b) * -(-cols // b) * FP8_SCALE_BYTES
        return total

    @property
    def indexer_layer_bytes(self) -> float:
        """One DSA indexer's projections (wq_b: q_lora -> H_I*d_I, wk: d -> d_I, weights_proj: d -> H_I)
        and its key LayerNorm: replicated on every rank in every layout (no head is sharded, nothing moves
        in a switch). 0 for a dense model."""
        c = self.cfg
        if not c.is_sparse:
            return 0.0
        d, hi, di = c.hidden_size, c.index_n_heads, c.index_head_dim
        return self.memo("indexer_layer", lambda: self._matrix_bytes(hi * di, int(c.q_lora_rank or d))
                         + self._matrix_bytes(di, d) + self._matrix_bytes(hi, d) + 2 * di * 2)

    def indexer_weight_bytes(self) -> float:
        """Every indexer layer's projections: the attention weights every rank holds whatever the layout."""
        return self.indexer_layer_bytes * len(self.cfg.indexer_layers)

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
        if not c.is_hybrid:
            return self.layers * ((qa + kva) * b + norms * 2) + c.hidden_size * 2
        n_mla, n_kda = len(self.mla_layers), len(self.kda_layers)
        return (n_mla * (qa + kva) * b + self.layers * norms * 2 + n_kda * self.kda_replicated_layer_bytes
                + c.hidden_size * 2)

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
        """W_r(l): rank `rank`'s head slice of every layer (W_A/T) when sharded, else W_A; plus a DSA
        model's indexer projections, replicated in either placement."""
        extra = self.indexer_weight_bytes()
        if not sharded:
            return self.w_a + extra
        mine = head_slice(self.heads, rank, ranks)
        if not self.cfg.is_hybrid:
            heads = self.memo(("w_rank", ranks, rank),
                              lambda: self.layers * sum(self.slice_bytes(p, mine) for p in self.projections))
            return heads + extra
        kmine = head_slice(self.kda_heads, rank, ranks)
        heads = self.memo(("w_rank", ranks, rank), lambda: (
            len(self.mla_layers) * sum(self.slice_bytes(p, mine) for p in self.projections)
            + len(self.kda_layers) * sum(self.slice_bytes(p, kmine) for p in self.kda_projections)))
        return heads + extra
