"""What state a request has, and where it lives in each layout: the one table of *stores*.

A request's state is a small set of stores (DESIGN.md, "State beyond the latent"). Each has a shape
rule (per token and paged, or per request and fixed), a head axis or not, and per layout a placement
derived from the ownership model (`splash.core.layouts`):

| store     | models        | per   | width per layer        | heads | TP         | DP, DOP | CP          |
|-----------|---------------|-------|------------------------|-------|------------|---------|-------------|
| `latent`  | every MLA     | token | d_c + d_r              | no    | replicated | owner   | by position |
| `index_k` | DSA (V3.2...) | token | index_head_dim         | no    | replicated | owner   | by position |

Per-token stores share the latent's pages: one page id names the same positions in every per-token
store (sibling tensors of one pool, as SGLang and vLLM keep the indexer's keys), so the allocator,
page tables, manifests and switch executor count and move pages once and carry every per-token store
with them. A head-free per-token store is placed exactly as the layout places KV pages
(`Layout.ownership`); nothing here is layout-specific beyond that rule.

Pure Python: the runtime's pool (`splash/kv/pool.py`) and the core's sizes/capacity/manifests ask this.
"""

from __future__ import annotations

from dataclasses import dataclass

from splash.core.config import ModelConfig


@dataclass(frozen=True)
class Store:
    """One kind of per-request state: `width` values per token (or per request) in each of `layers`."""

    name: str
    width: int
    layers: tuple[int, ...]
    per: str = "token"  # "token": paged with the latent; "request": one fixed slot per request
    heads: bool = False  # a head axis (sharded with head-sharded projections); per-token stores have none

    @property
    def values_per_token(self) -> int:
        """Values one token adds to this store over all its layers (0 for per-request stores)."""
        return self.width * len(self.layers) if self.per == "token" else 0


def stores(cfg: ModelConfig) -> tuple[Store, ...]:
    """The stores a request of model `cfg` has, the latent first."""
    out = [Store("latent", cfg.latent_dim, tuple(range(cfg.num_hidden_layers)))]
    if cfg.is_sparse:
        out.append(Store("index_k", cfg.index_head_dim, cfg.indexer_layers))
    return tuple(out)


def token_stores(cfg: ModelConfig) -> tuple[Store, ...]:
    """The per-token (paged) stores: what a KV page holds."""
    return tuple(s for s in stores(cfg) if s.per == "token")


def values_per_token(cfg: ModelConfig) -> int:
    """KV values one token takes over all layers and per-token stores (latent + indexer keys)."""
    return sum(s.values_per_token for s in token_stores(cfg))

