"""What state a request has, and where it lives in each layout: the one table of *stores*.

A request's state is a small set of stores (DESIGN.md, "State beyond the latent"). Each has a shape
rule (per token and paged, or per request and fixed), a head axis or not, and per layout a placement
derived from the ownership model (`splash.core.layouts`):

| store       | models     | per     | width per layer       | heads | TP      | DP    | CP       | DOP     |
|-------------|------------|---------|-----------------------|-------|---------|-------|----------|---------|
| `latent`    | MLA layers | token   | d_c + d_r             | no    | repl.   | owner | position | owner   |
| `index_k`   | DSA layers | token   | index_head_dim        | no    | repl.   | owner | position | owner   |
| `kda_state` | KDA layers | request | H_l * d * d (fp32)    | yes   | heads   | owner | repl.    | heads   |
| `kda_conv`  | KDA layers | request | 3 * H_l * d * (K - 1) | yes   | heads   | owner | repl.    | heads   |
| `mtp_latent`| MTP layers | token   | d_c + d_r             | no    | repl.   | owner | position | owner   |
| `mtp_index_k`| MTP of DSA| token   | index_head_dim        | no    | repl.   | owner | position | owner   |

(repl.: every rank; position: page j on rank j % T; heads: each rank its head slice of every request.
H_l, d, K: a KDA layer's heads, head dim and conv kernel; a hybrid's latent lives in its MLA layers only.
The `mtp_*` rows are the draft model's KV (speculative decoding with the checkpoint's MTP layers, only
while it is on): a per-token store of the request like the latent, in the same pages; `base` names the
store whose tensor holds it as extra layers, so the pool, attention and switches need nothing new.)

Per-token stores share the latent's pages: one page id names the same positions in every per-token
store (sibling tensors of one pool, as SGLang and vLLM keep the indexer's keys), so the allocator,
page tables, manifests and switch executor count and move pages once and carry every per-token store
with them. A head-free per-token store is placed exactly as the layout places KV pages
(`Layout.ownership`); nothing here is layout-specific beyond that rule.

A per-request store with a head axis (KDA's recurrent and conv states) is placed by
`Layout.state_placement`, the one rule derived from the layout's projection placement and KV ownership:
head-sharded projections (TP, DOP) -> each rank holds its heads' slice of every request's state (no
replica, no exchange: the rank that projects a head updates its state); replicated projections with
owners (DP) -> the owner holds the whole state; replicated projections without owners (CP: every rank
has every row) -> every rank holds (and updates) the whole state. `state_share` answers it per rank.
The prefix cache's KDA snapshots (splash/kv/snapshots.py) are more rows of the same two stores, one per
cached prompt end rather than per request, placed by the same rule (`snapshot_bytes`).

Element formats (`--kv-cache-dtype`): how a per-token store's values sit in bytes, one more column of
the table. A plain format keeps every value in one dtype; the FP8 formats pack each token's row:

| format      | `latent` row (d_c + d_r values)                         | `index_k` row (DSA layers)         |
|-------------|---------------------------------------------------------|------------------------------------|
| plain `dt`  | d_c + d_r values of dt                                  | index_head_dim values of dt        |
| `fp8_e4m3`  | d_c + d_r FP8 e4m3 (one float32 scale per layer, kept   | FP8 e4m3, a float32 scale per 128  |
|             | beside the pool, not per token)                         |                                    |
|`fp8_ds_mla` | d_c FP8 e4m3, a float32 scale per 128 of them, d_r BF16 | FP8 e4m3, a float32 scale per 128  |

`fp8_ds_mla` is DeepSeek-V3.2's cache (FlashMLA's 656-byte token: 512 + 4 x 4 + 64 x 2) and the layout
the paper counts (appendix B.1: 788 bytes a V3.2 layer with the indexer's 128 + 4); `fp8` names it. The
indexer's keys are FP8 with their scale in both FP8 formats, as DeepSeek stores them. An `mtp_*` store
takes its base store's row. `store_parts` is the one rule; bytes per token (`splash.core.sizes`), the
runtime pool's rows and its codecs (`splash/kv/codec.py`) all read it.

Pure Python: the runtime's pool (`splash/kv/pool.py`) and the core's sizes/capacity/manifests ask this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splash.core.model_config import (
    DTYPE_BYTES,
    ConfigError,
    ModelConfig,
    dtype_bytes,
    head_slice,
    normalize_dtype,
)

if TYPE_CHECKING:
    from splash.core.layouts import Layout


@dataclass(frozen=True)
class Store:
    """One kind of per-request state: `width` values per token (or per request) in each of `layers`."""

    name: str
    width: int
    layers: tuple[int, ...]
    per: str = "token"  # "token": paged with the latent; "request": one fixed slot per request
    heads: bool = False  # a head axis (sharded with head-sharded projections); per-token stores have none
    head_count: int = 0  # heads along that axis (KDA: linear_num_heads); width divides evenly by it
    dtype: str = "kv"  # "kv": the KV dtype; "state": the recurrent-state dtype; "act": the activations'
    base: str = ""  # a per-token store kept as extra layers of another's tensor (MTP layers' KV)

    @property
    def values_per_token(self) -> int:
        """Values one token adds to this store over all its layers (0 for per-request stores)."""
        return self.width * len(self.layers) if self.per == "token" else 0

    @property
    def head_width(self) -> int:
        """Values one head holds per layer (the whole width for a head-free store)."""
        return self.width // self.head_count if self.heads and self.head_count else self.width


def stores(cfg: ModelConfig) -> tuple[Store, ...]:
    """The stores a request of model `cfg` has, the latent first."""
    out = [Store("latent", cfg.latent_dim, cfg.mla_layers)]
    if cfg.is_sparse:
        out.append(Store("index_k", cfg.index_head_dim, cfg.indexer_layers))
    if cfg.is_hybrid:
        H, d, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
        kda = tuple(cfg.kda_layers or ())
        out.append(Store("kda_state", H * d * d, kda, "request", True, H, "state"))
        out.append(Store("kda_conv", 3 * H * d * max(K - 1, 0), kda, "request", True, H, "act"))
    if cfg.draft_layers:
        out.append(Store("mtp_latent", cfg.latent_dim, cfg.mtp_layers, base="latent"))
        if cfg.is_sparse:
            out.append(Store("mtp_index_k", cfg.index_head_dim, cfg.mtp_layers, base="index_k"))
    return tuple(out)


def token_stores(cfg: ModelConfig) -> tuple[Store, ...]:
    """The per-token (paged) stores: what a KV page holds."""
    return tuple(s for s in stores(cfg) if s.per == "token")


def values_per_token(cfg: ModelConfig) -> int:
    """KV values one token takes over all layers and per-token stores (latent + indexer keys)."""
    return sum(s.values_per_token for s in token_stores(cfg))



# ---- element formats of the per-token stores (`--kv-cache-dtype`) -----------------------------------
FP8_FORMATS = ("fp8_e4m3", "fp8_ds_mla")
KV_FORMAT_ALIASES = {"fp8": "fp8_ds_mla", "float8": "fp8_ds_mla", "fp8_ds": "fp8_ds_mla",
                     "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
FP8_GROUP = 128  # values per float32 scale in an FP8 row (DeepSeek's tiles: FlashMLA and the indexer)
FP8_MAX = 448.0  # the largest finite FP8 e4m3 value
SCALE_DTYPE = "fp32"


@dataclass(frozen=True)
class Part:
    """One run of a token's row in a store: `values` values kept as `dtype`, then (`group` > 0) one
    float32 scale per `group` of them, the last group possibly short."""

    values: int
    dtype: str
    group: int = 0

    @property
    def scales(self) -> int:
        return -(-self.values // self.group) if self.group else 0

    @property
    def value_bytes(self) -> int:
        return int(self.values * DTYPE_BYTES[self.dtype])

    @property
    def nbytes(self) -> int:
        return self.value_bytes + self.scales * int(DTYPE_BYTES[SCALE_DTYPE])


def kv_format(name: str) -> str:
    """The canonical name of a KV element format: a plain dtype (`bf16`, `fp32`, ...), `fp8_e4m3` or
    `fp8_ds_mla` (`fp8` is DeepSeek's layout, the paper's); ConfigError on anything else."""
    key = str(name).lower().strip()
    key = KV_FORMAT_ALIASES.get(key, key)
    if key in FP8_FORMATS:
        return key
    if key == "fp8_e5m2":
        raise ConfigError("kv cache dtype fp8_e5m2 is not supported; use fp8_e4m3 or fp8_ds_mla")
    try:
        return normalize_dtype(key)
    except ConfigError:
        raise ConfigError(f"unknown KV cache dtype {name!r}; choose one of auto, bfloat16, float32, "
                          "float64, fp8 (= fp8_ds_mla), fp8_e4m3, fp8_ds_mla") from None


def latent_parts(d_c: int, d_r: int, fmt: str) -> tuple[Part, ...]:
    """A latent row (d_c normed values, then d_r rotary-key values) under format `fmt`, in order (the
    kernels ask it by dims alone)."""
    fmt = kv_format(fmt)
    if fmt not in FP8_FORMATS:
        return (Part(d_c + d_r, fmt),)
    if fmt == "fp8_e4m3":  # one per-layer scale, outside the row
        return (Part(d_c + d_r, "fp8"),)
    return (Part(d_c, "fp8", FP8_GROUP), Part(d_r, "bf16"))


def store_parts(cfg: ModelConfig, store: Store, fmt: str) -> tuple[Part, ...]:
    """How one token's values of `store` (one layer) sit in its row under format `fmt`, in order."""
    fmt = kv_format(fmt)
    if store.per != "token":
        raise ConfigError(f"store {store.name!r} is per request: it has no KV element format")
    if (store.base or store.name) == "latent":
        return latent_parts(cfg.kv_lora_rank, cfg.qk_rope_head_dim, fmt)
    if fmt not in FP8_FORMATS:
        return (Part(store.width, fmt),)
    return (Part(store.width, "fp8", FP8_GROUP),)  # the indexer's keys: FP8 + a scale per 128, as DeepSeek


def store_row_bytes(cfg: ModelConfig, store: Store, fmt: str) -> int:
    """Bytes one token takes in `store` in one of its layers under `fmt`."""
    return sum(p.nbytes for p in store_parts(cfg, store, fmt))


def request_stores(cfg: ModelConfig) -> tuple[Store, ...]:
    """The per-request (fixed-size) stores: a KDA layer's recurrent and conv states; () unless hybrid."""
    return tuple(s for s in stores(cfg) if s.per == "request")


# ---- dtypes and bytes of the per-request stores ------------------------------------------------------
def state_dtype(dtype: str, state: str | None = None) -> str:
    """The recurrent state's dtype: `state` if given, else float32 (vLLM and FLA keep KDA's state in
    float32 even for bf16 models), float64 for a float64 model."""
    if state is not None:
        return normalize_dtype(state)
    return "fp64" if normalize_dtype(dtype) == "fp64" else "fp32"


def act_dtype(dtype: str) -> str:
    """The activations' dtype of a model whose weights are `dtype` (the conv states hold activations):
    the weight dtype, but bf16 for fp8 weights (FP8 checkpoints compute in bf16)."""
    dt = normalize_dtype(dtype)
    return "bf16" if dt == "fp8" else dt


def store_request_bytes(store: Store, dtype: str, state: str | None = None) -> float:
    """Bytes one request holds in `store` in one of its layers (all heads) for weights of `dtype`."""
    if store.per != "request":
        raise ConfigError(f"store {store.name!r} is per token, not per request")
    dt = state_dtype(dtype, state) if store.dtype == "state" else act_dtype(dtype)
    return store.width * dtype_bytes(dt)


def request_state_bytes(cfg: ModelConfig, dtype: str = "bf16", state: str | None = None) -> float:
    """z: bytes of one request's per-request state over every layer (KDA recurrent + conv states; 0 for
    a pure MLA model). Constant in its context."""
    return sum(store_request_bytes(s, dtype, state) * len(s.layers) for s in request_stores(cfg))


def snapshot_bytes(cfg: ModelConfig, dtype: str = "bf16", state: str | None = None) -> float:
    """Bytes of one prefix-cache snapshot of a hybrid's KDA state, all heads: one request's state
    (`request_state_bytes`), kept with a cached prefix and placed as live state is."""
    return request_state_bytes(cfg, dtype, state)


def layer_state_bytes(cfg: ModelConfig, dtype: str = "bf16", state: str | None = None) -> float:
    """One request's per-request state in one KDA layer, all heads (every KDA layer alike)."""
    return sum(store_request_bytes(s, dtype, state) for s in request_stores(cfg))


# ---- placement of the per-request stores ----------------------------------------------------------------
def state_share(store: Store, layout: Layout, rank: int, ranks: int, owner: int) -> range | None:
    """The heads of `store` that `rank` holds for a request owned by `owner` in `layout` (None: none).

    The placement rule (`Layout.state_placement`): head-sharded -> the rank's head slice (all heads at
    T = 1), owner -> every head on the owner only, replicated -> every head on every rank. A head-free
    per-request store counts as one head."""
    if store.per != "request":
        raise ConfigError(f"store {store.name!r} is per token: its pages follow Layout.page_ranks")
    heads = store.head_count if store.heads and store.head_count else 1
    kind = layout.state_placement.value
    if kind == "head-sharded":
        return head_slice(heads, rank, ranks) if ranks > 1 and store.heads else range(heads)
    if kind == "owner":
        return range(heads) if rank == owner else None
    return range(heads)


def state_fraction(layout: Layout, rank: int, ranks: int, owner: int) -> float:
    """g: the share of one request's per-request state `rank` holds (1/T, 1 or 0 on a non-owner, 1)."""
    kind = layout.state_placement.value
    if kind == "head-sharded":
        return 1.0 / ranks
    if kind == "owner":
        return 1.0 if rank == owner else 0.0
    return 1.0
