"""One rank's paged latent-KV pool: a single tensor [L, num_pages, page_size, d_c + d_r].

Each token's entry per layer is the normed `c_kv` followed by the roped `k_pe` (absorbed MLA needs
nothing else). The pool only stores; which pages belong to which request is the allocator's job
(`splash/kv/allocator.py`, on rank 0), and the step plan's page tables say where rows go.
"""

from __future__ import annotations

import torch

from splash.core.config import ConfigError, ModelConfig


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if num_pages < 1 or page_size < 1:
            raise ConfigError(f"KV pool needs at least one page of at least one token "
                              f"(got {num_pages} pages of {page_size})")
        self.num_layers, self.num_pages, self.page_size, self.dim = num_layers, num_pages, page_size, dim
        self.dtype = dtype
        self.device = torch.device(device or "cpu")
        self.data = torch.zeros(num_layers, num_pages, page_size, dim, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return cfg.num_hidden_layers * page_size * cfg.latent_dim * elem

    @classmethod
    def pages_for_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return int(budget_bytes // cls.bytes_per_page(cfg, page_size, dtype))

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int = 16,
                    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> KVPool:
        """As many whole pages as `budget_bytes` holds (all layers of a token count together)."""
        n = cls.pages_for_budget(cfg, budget_bytes, page_size, dtype)
        if n < 1:
            need = cls.bytes_per_page(cfg, page_size, dtype)
            raise ConfigError(f"a KV budget of {budget_bytes} bytes holds no page ({need} bytes per page of "
                              f"{page_size} tokens); raise --memory-per-rank or lower the page size")
        return cls(cfg.num_hidden_layers, n, page_size, cfg.latent_dim, dtype, device)

    @property
    def num_tokens(self) -> int:
        """Capacity in tokens (of every layer)."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> torch.Tensor:
        """View [num_pages, page_size, D] of layer i."""
        return self.data[i]

    def flat_layer(self, i: int) -> torch.Tensor:
        """View [num_pages * page_size, D] of layer i (slot = page * page_size + offset)."""
        return self.data[i].view(-1, self.dim)

    def write(self, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` [k, D] at flat `slots` [k] of layer i."""
        if slots.numel():
            self.flat_layer(i).index_copy_(0, slots, rows.to(self.dtype))

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """[L, len(pages), P, D] copy of some pages (for moving them between ranks)."""
        return self.data[:, pages]

    def write_pages(self, pages: torch.Tensor, blocks: torch.Tensor) -> None:
        self.data[:, pages] = blocks.to(self.device, self.dtype)
