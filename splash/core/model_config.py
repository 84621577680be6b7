"""Frozen, typed configuration: model dimensions (from a HF config.json or a preset) and dtypes.

Pure Python: the analytical core and the runtime both read these, and neither needs torch here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Bytes per element of each dtype name we accept on the command line.
DTYPE_BYTES: dict[str, float] = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DTYPE_ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "float8": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8",
}
SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa",
                         "kimi_linear")
# DeepSeek Sparse Attention (DSA): MLA plus a lightning indexer per layer (SPEC §9).
SPARSE_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# Hybrids: MLA layers interleaved with Kimi Delta Attention (KDA) layers, which keep a per-request
# recurrent state instead of a per-token cache (SPEC §10).
HYBRID_MODEL_TYPES = ("kimi_linear",)


class ConfigError(ValueError):
    """A configuration the user gave is invalid; the message says what to change."""


def normalize_dtype(name: str) -> str:
    """Return the canonical short dtype name (`bf16`, `fp8`, ...) or raise ConfigError."""
    key = str(name).lower().strip()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_BYTES)}")
    return key


def dtype_name(dtype: object) -> str:
    """'bf16', torch.bfloat16, 'float64' ... -> the canonical short dtype name (no torch needed here)."""
    return normalize_dtype(str(dtype).removeprefix("torch."))


def dtype_bytes(name: str) -> float:
    return DTYPE_BYTES[normalize_dtype(name)]


def head_slice(heads: int, rank: int, ranks: int) -> range:
    """The heads whose projection slices `rank` holds when projections are sharded over `ranks`: its
    contiguous 1/T slice (`ModelConfig.check_ranks` refuses a T that does not divide the heads). The one
    definition of heads-per-rank; `Layout.heads` (splash/core/layouts.py) adds the replicated case."""
    per = heads // ranks
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of an MLA model of the DeepSeek-V2/V3 family (field names follow HF's config)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int | None
    num_experts_per_tok: int | None
    n_group: int | None = 1
    topk_group: int | None = 1
    topk_method: str = "noaux_tc"  # V3: noaux_tc; V2: greedy | group_limited_greedy
    scoring_func: str = "sigmoid"  # V3: sigmoid; V2: softmax
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # DeepSeek Sparse Attention (V3.2, GLM-5): None for dense MLA models. The indexer scores every key
    # with index_n_heads heads of index_head_dim; each query's main attention reads its top index_topk.
    index_topk: int | None = None
    index_head_dim: int = 0
    index_n_heads: int = 0
    # Per layer: "full" runs an indexer, "shared" reuses the previous full layer's top-k (GLM-5).
    # None with index_topk set: every layer full (V3.2).
    indexer_types: tuple[str, ...] | None = None
    index_rope_interleave: bool = False  # the indexer's rotary: V3.2 half-split, GLM-5 interleaved
    # Hybrid linear attention (Kimi-Linear, GLM-5.3-Flash's shape): the 0-based layers that run KDA
    # (Kimi Delta Attention) instead of MLA; None for pure MLA models. A KDA layer has
    # linear_num_heads heads of linear_head_dim (q, k and v alike), short causal convolutions of
    # linear_conv_kernel taps, and a per-request state [heads, d_k, d_v] plus conv states.
    kda_layers: tuple[int, ...] | None = None
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    linear_conv_kernel: int = 0
    # False: the MLA layers apply no rotary embedding (Kimi-Linear's NoPE MLA; the d_r part of the
    # keys is still shared and cached, just not rotated).
    use_rope: bool = True
    # Multi-token prediction (DeepSeek-V3/V3.2, GLM-5): MTP layers the checkpoint carries after its last
    # decoder layer (`num_nextn_predict_layers`, layer ids num_hidden_layers + i), and how many of them
    # serving loads (`draft_layers`: speculative decoding with MTP on; 0 otherwise, so their KV costs
    # nothing when unused).
    num_nextn_predict_layers: int = 0
    draft_layers: int = 0
    # Checkpoint quantisation (e.g. DeepSeek-V3's FP8 128x128 block scales), as read from config.json.
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)

    # ---- derived dimensions -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's cached latent per layer in absorbed MLA: d_c + d_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_sparse(self) -> bool:
        """A DSA model: each query's MLA reads only the keys its layer's indexer selects."""
        return self.index_topk is not None

    def indexer_type(self, layer: int) -> str | None:
        """"full" (an indexer of its own), "shared" (the previous full layer's top-k) or None (dense)."""
        if not self.is_sparse:
            return None
        if self.indexer_types is None or layer >= self.num_hidden_layers:  # (an MTP layer: its own)
            return "full"
        return self.indexer_types[layer]

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Layers with an indexer, hence with an indexer key cache (a per-token store of index_head_dim)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.indexer_type(i) == "full")

    @property
    def is_hybrid(self) -> bool:
        """MLA layers interleaved with KDA layers (per-request recurrent state)."""
        return bool(self.kda_layers)

    def layer_kind(self, layer: int) -> str:
        """"mla" or "kda": what the attention of `layer` is."""
        return "kda" if self.kda_layers and layer in self.kda_layers else "mla"

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        """The MTP layers serving loads (draft model of speculative decoding): ids after the last layer."""
        return tuple(range(self.num_hidden_layers, self.num_hidden_layers + self.draft_layers))

    @property
    def num_attn_layers(self) -> int:
        """Layers with attention weights and KV a layout places and a switch moves: the decoder's and
        the served MTP layers'."""
        return self.num_hidden_layers + self.draft_layers

    def with_draft(self, on: bool) -> ModelConfig:
        """This config serving its MTP layers (speculative decoding with MTP) or not."""
        if on and not self.num_nextn_predict_layers:
            raise ConfigError(f"{self.name} has no MTP layers (num_nextn_predict_layers is 0 in its config): "
                              "use --speculative-algorithm NGRAM, or a checkpoint with MTP layers")
        return dataclasses.replace(self, draft_layers=self.num_nextn_predict_layers if on else 0)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """Layers with MLA attention, hence with a latent cache (every layer unless hybrid)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_kind(i) == "mla")

    @property
    def linear_qkv_dim(self) -> int:
        """Width of a KDA layer's q (and k, v) projection: linear_num_heads x linear_head_dim."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def is_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.is_moe
            and layer >= self.first_k_dense_replace
            and layer % max(1, self.moe_layer_freq) == 0
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    def check_ranks(self, ranks: int) -> None:
        """Refuse a rank count that cannot shard the attention heads evenly."""
        if ranks < 1:
            raise ConfigError(f"--ranks must be >= 1, got {ranks}")
        if self.num_attention_heads % ranks:
            raise ConfigError(
                f"{self.name}: {self.num_attention_heads} attention heads cannot be split evenly over "
                f"{ranks} ranks; choose a rank count that divides {self.num_attention_heads}"
            )
        if self.is_hybrid and self.linear_num_heads % ranks:
            raise ConfigError(
                f"{self.name}: {self.linear_num_heads} KDA heads cannot be split evenly over {ranks} "
                f"ranks; choose a rank count that divides {self.linear_num_heads}"
            )

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str | None = None) -> ModelConfig:
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {mt!r} is not an MLA model splash serves; expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = d.get("text_config")
        if isinstance(text, dict) and "kv_lora_rank" not in d:
            d = {**d, **text}
        hybrid = _hybrid_fields(d) if mt in HYBRID_MODEL_TYPES else {}
        if hybrid:
            d = {**d, **hybrid.pop("_aliases")}
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"config is missing required field(s): {', '.join(missing)}")
        # transformers 5 writes `rope_parameters` (holding rope_theta too); hub checkpoints write
        # `rope_scaling` + `rope_theta`.
        rope = d.get("rope_scaling") or None
        params = d.get("rope_parameters") or None
        theta = d.get("rope_theta")
        if isinstance(params, dict):
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", params.get("type", "default")) not in (None, "default"):
                rope = {k: v for k, v in params.items() if k != "rope_theta"}
        if isinstance(rope, dict):
            rope = dict(rope)
            kind = rope.get("rope_type", rope.get("type"))
            if kind in (None, "default"):
                rope = None
            else:
                rope["rope_type"] = kind
        is_v2 = mt == "deepseek_v2"
        get = d.get
        sparse = _sparse_fields(d) if mt in SPARSE_MODEL_TYPES else {}
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "vocab_size"):
            if not isinstance(get(k), int) or get(k) <= 0:
                raise ConfigError(f"config field {k} must be a positive integer, got {get(k)!r}")
        return cls(
            name=name or d.get("_name_or_path") or mt,
            model_type=mt,
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size") or 4 * get("hidden_size")),
            moe_intermediate_size=int(get("moe_intermediate_size") or get("intermediate_size") or 0),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            q_lora_rank=None if get("q_lora_rank") in (None, 0) else int(get("q_lora_rank")),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            n_group=get("n_group") or 1,
            topk_group=get("topk_group") or 1,
            topk_method=get("topk_method") or ("greedy" if is_v2 else "noaux_tc"),
            scoring_func=get("scoring_func") or ("softmax" if is_v2 else "sigmoid"),
            norm_topk_prob=bool(get("norm_topk_prob", not is_v2)),
            routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=int(get("first_k_dense_replace") or 0),
            moe_layer_freq=int(get("moe_layer_freq") or 1),
            rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
            rope_theta=float(theta or 10000.0),
            rope_scaling=rope,
            rope_interleave=True if sparse else bool(get("rope_interleave", True)),
            max_position_embeddings=int(get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            hidden_act=get("hidden_act") or "silu",
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            pad_token_id=get("pad_token_id"),
            quantization_config=get("quantization_config"),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers") or 0),
            **sparse,
            **hybrid,
        )

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read a Hugging Face `config.json` (a file, or a checkpoint directory holding one)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.isfile(p):
            raise ConfigError(f"no config.json at {path!r}; pass a checkpoint directory or a preset name")
        try:
            with open(p, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not a JSON model config: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p} is not a JSON object")
        return cls.from_dict(d, name=os.path.basename(os.path.dirname(os.path.abspath(p))))


def _sparse_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The DSA fields of a deepseek_v32 / glm_moe_dsa config.json, validated (as transformers derives
    them: GLM's `indexer_types` from `index_topk_pattern` or `index_topk_freq`/`index_skip_topk_offset`)."""
    mt, n = d["model_type"], int(d["num_hidden_layers"])
    glm = mt == "glm_moe_dsa"
    topk = d.get("index_topk", 2048)
    dim = d.get("index_head_dim", 128)
    heads = d.get("index_n_heads", 32 if glm else 64)
    for k, v in (("index_topk", topk), ("index_head_dim", dim), ("index_n_heads", heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{mt} config field {k} must be a positive integer, got {v!r}")
    rope = d.get("qk_rope_head_dim")
    if isinstance(rope, int) and rope > dim:
        raise ConfigError(f"{mt}: the indexer's rotary part (qk_rope_head_dim={rope}) is wider than its "
                          f"head (index_head_dim={dim}); splash's indexer needs qk_rope_head_dim <= "
                          "index_head_dim")
    if isinstance(rope, int) and rope % 2:
        raise ConfigError(f"{mt}: qk_rope_head_dim={rope} must be even for the indexer's rotary")
    if not d.get("q_lora_rank"):
        raise ConfigError(f"{mt}: the DSA indexer reads the query latent, so q_lora_rank must be set")
    types: tuple[str, ...] | None = None
    if glm:
        raw = d.get("indexer_types")
        if raw is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                raw = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) \
                    else list(pattern)
            else:
                freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
                off = int(d.get("index_skip_topk_offset", 2))
                raw = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
        types = tuple(str(t) for t in raw)
        if len(types) != n or any(t not in ("full", "shared") for t in types):
            raise ConfigError(f"{mt}: indexer_types must name 'full' or 'shared' for each of the {n} layers, "
                              f"got {list(types)!r}")
        if types and types[0] != "full":
            raise ConfigError(f"{mt}: layer 0 is 'shared' but no earlier layer has an indexer to share")
        if all(t == "full" for t in types):
            types = None
    return {"index_topk": int(topk), "index_head_dim": int(dim), "index_n_heads": int(heads),
            "indexer_types": types, "index_rope_interleave": glm}


def _hybrid_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The KDA fields of a kimi_linear config.json, validated, plus `_aliases`: Kimi's names for the
    fields every MLA model has (num_experts, moe_renormalize, ...), mapped to DeepSeek's, and the dense
    prefix its `mlp_layer_types` names. Layers are 1-based in `linear_attn_config` (as transformers
    reads them) and `layer_types` wins when present."""
    mt, n = d["model_type"], int(d["num_hidden_layers"])
    lin = d.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"{mt}: linear_attn_config must be an object, got {lin!r}")
    types = d.get("layer_types")
    if types is None:
        if "kda_layers" in lin and "full_attn_layers" in lin:
            types = [None] * n
            for i in lin["full_attn_layers"]:
                types[int(i) - 1] = "full_attention"
            for i in lin["kda_layers"]:
                types[int(i) - 1] = "linear_attention"
        else:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in ("full_attention", "linear_attention") for t in types):
        raise ConfigError(f"{mt}: layer_types must name 'full_attention' or 'linear_attention' for each of "
                          f"the {n} layers, got {list(types)!r}")
    heads = lin.get("num_heads", d.get("linear_num_heads", 32))
    dim = lin.get("head_dim", d.get("linear_head_dim", 128))
    kernel = lin.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4))
    for k, v in (("linear num_heads", heads), ("linear head_dim", dim), ("short_conv_kernel_size", kernel)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{mt} config field {k} must be a positive integer, got {v!r}")
    kvh = d.get("num_key_value_heads")
    if kvh is not None and kvh != d.get("num_attention_heads"):
        raise ConfigError(f"{mt}: num_key_value_heads={kvh} differs from num_attention_heads; MLA has "
                          "one latent for every head")
    mlp = d.get("mlp_layer_types")
    dense = int(d.get("first_k_dense_replace", 1) or 0)
    if mlp is not None:
        dense = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
        if list(mlp) != ["dense"] * dense + ["sparse"] * (n - dense):
            raise ConfigError(f"{mt}: mlp_layer_types must be dense layers then sparse ones, got {mlp!r}")
    get = d.get
    aliases = {
        "n_routed_experts": get("n_routed_experts") or get("num_experts") or get("num_local_experts"),
        "n_shared_experts": get("n_shared_experts") or get("num_shared_experts"),
        "num_experts_per_tok": get("num_experts_per_tok") or get("num_experts_per_token"),
        "norm_topk_prob": get("norm_topk_prob", get("moe_renormalize", True)),
        "n_group": get("n_group") or get("num_expert_group") or 1,
        "max_position_embeddings": get("max_position_embeddings") or get("model_max_length"),
        "first_k_dense_replace": dense, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    }
    kda = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    return {"kda_layers": kda or None, "linear_num_heads": int(heads), "linear_head_dim": int(dim),
            "linear_conv_kernel": int(kernel), "use_rope": False, "_aliases": aliases}
