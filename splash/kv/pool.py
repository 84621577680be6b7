"""One rank's paged KV pool: the latent tensor [L, num_pages, page_size, d_c + d_r] and a sibling tensor
per other per-token store (the DSA indexer's keys, [L_I, num_pages, page_size, index_head_dim]).

Each token's latent entry per layer is the normed `c_kv` followed by the roped `k_pe` (absorbed MLA
needs nothing else). Every per-token store of `splash.core.stores` shares the latent's page ids: a page
id names the same positions in each, so one allocator, one page table and one switch manifest serve
them all, and a page's bytes are the sum of its stores' (`bytes_per_page`). The pool only stores;
which pages belong to which request is the allocator's job (`splash/kv/allocator.py`, on rank 0), and
the step plan's page tables say where rows go.
"""

from __future__ import annotations

import torch

from splash.core.config import ConfigError, ModelConfig
from splash.core.stores import token_stores, values_per_token


def key_slots(pages: torch.Tensor, ctx_len: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat slots into a layer's [num_pages * P, D] view, positions) of the keys a page table holds.

    `pages[j]` is the local id of global page j or -1; only positions < ctx_len are returned."""
    n = pages.shape[0]
    dev = pages.device
    pos = torch.arange(n * page_size, device=dev).view(n, page_size)
    held = (pages >= 0)[:, None].expand(n, page_size)
    mask = held & (pos < ctx_len)
    slots = pages[:, None] * page_size + torch.arange(page_size, device=dev)[None, :]
    return slots[mask], pos[mask]


class KVPool:
    """`extra`: the per-token stores beside the latent, name -> (layers that have it, width).
    `latent_layers`: the model layers that have a latent, in order (default 0 .. num_layers-1); a
    hybrid's KDA layers have none. Every method takes *model* layer ids: `_lat` maps them to the
    latent tensor's rows, in this one place."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 extra: dict[str, tuple[tuple[int, ...], int]] | None = None,
                 latent_layers: tuple[int, ...] | None = None) -> None:
        if num_pages < 1 or page_size < 1:
            raise ConfigError(f"KV pool needs at least one page of at least one token "
                              f"(got {num_pages} pages of {page_size})")
        if latent_layers is not None and len(latent_layers) != num_layers:
            raise ValueError(f"{num_layers} latent layers but {len(latent_layers)} layer ids given")
        self.num_layers, self.num_pages, self.page_size, self.dim = num_layers, num_pages, page_size, dim
        self.latent_layers = tuple(range(num_layers)) if latent_layers is None else tuple(latent_layers)
        self._lat = {layer: k for k, layer in enumerate(self.latent_layers)}
        self.dtype = dtype
        self.device = torch.device(device or "cpu")
        self.data = torch.zeros(num_layers, num_pages, page_size, dim, dtype=dtype, device=self.device)
        # name -> [len(layers), num_pages, page_size, width]; row of layer i in `_rows[name][i]`
        self.extra: dict[str, torch.Tensor] = {}
        self._rows: dict[str, dict[int, int]] = {}
        self._widths: dict[str, int] = {}
        for name, (layers, width) in (extra or {}).items():
            self.extra[name] = torch.zeros(len(layers), num_pages, page_size, width, dtype=dtype,
                                           device=self.device)
            self._rows[name] = {layer: k for k, layer in enumerate(layers)}
            self._widths[name] = width

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> KVPool:
        """A pool holding every per-token store of `cfg` (the latent, and the indexer keys of a DSA model)."""
        ts = token_stores(cfg)
        layers = {s.name: tuple(s.layers) for s in ts if not s.base}
        for s in ts:  # a store kept in another's tensor: its layers are that tensor's extra rows
            if s.base:
                layers[s.base] += tuple(s.layers)
        extra = {s.name: (layers[s.name], s.width) for s in ts if s.name != "latent" and not s.base}
        # the latent's layers: what the stores table says (a hybrid's MLA layers only)
        lat = layers.get("latent", tuple(range(cfg.num_hidden_layers)))
        if cfg.is_hybrid:
            lat = tuple(i for i in lat if cfg.layer_kind(i) == "mla")
        return cls(len(lat), num_pages, page_size, cfg.latent_dim, dtype, device, extra, latent_layers=lat)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page takes over every layer and per-token store (`splash.core.stores`)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return page_size * values_per_token(cfg) * elem

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
        return cls.for_model(cfg, n, page_size, dtype, device)

    @property
    def num_tokens(self) -> int:
        """Capacity in tokens (of every layer)."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every store's tensor, the latent first (page axis 1 in each)."""
        return [self.data, *self.extra.values()]

    def store_flat(self, name: str, i: int) -> torch.Tensor:
        """View [num_pages * page_size, width] of store `name` in layer i."""
        if name == "latent":
            return self.flat_layer(i)
        return self.extra[name][self._rows[name][i]].view(-1, self._widths[name])

    def write_store(self, name: str, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` [k, width] at flat `slots` [k] of store `name` in layer i."""
        if slots.numel():
            self.store_flat(name, i).index_copy_(0, slots, rows.to(self.dtype))

    def _extra_of(self, i: int) -> list[tuple[str, int]]:
        """(name, width) of the stores beside the latent that layer i has, in pool order."""
        return [(n, self._widths[n]) for n in self.extra if i in self._rows[n]]

    def layer_width(self, i: int) -> int:
        """Values per token of layer i over every per-token store (what a switch moves per token)."""
        return self.dim + sum(w for _, w in self._extra_of(i))

    def read_rows(self, i: int, slots: torch.Tensor) -> torch.Tensor:
        """[k, layer_width(i)]: every store's values of layer i at `slots`, side by side (latent first)."""
        parts = [self.flat_layer(i).index_select(0, slots)]
        parts += [self.store_flat(n, i).index_select(0, slots) for n, _ in self._extra_of(i)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def write_rows(self, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of `read_rows`: rows [k, layer_width(i)] split back into the stores of layer i."""
        self.write(i, slots, rows[:, :self.dim])
        at = self.dim
        for n, w in self._extra_of(i):
            self.write_store(n, i, slots, rows[:, at:at + w])
            at += w

    def release(self) -> tuple[torch.Size, ...]:
        """Free every store's memory (shapes returned for `restore`)."""
        shapes = tuple(t.shape for t in self.tensors())
        self.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.extra = {n: torch.empty(0, dtype=self.dtype, device=self.device) for n in self.extra}
        return shapes

    def restore(self, shapes: tuple[torch.Size, ...]) -> None:
        """Zeroed stores of the shapes `release` returned."""
        self.data = torch.zeros(shapes[0], dtype=self.dtype, device=self.device)
        self.extra = {n: torch.zeros(sh, dtype=self.dtype, device=self.device)
                      for n, sh in zip(self.extra, shapes[1:])}

    def poison(self, pages: torch.Tensor) -> None:
        """Debug aid: NaN into `pages` of every store, so a later read of them shows in the logits."""
        for t in self.tensors():
            t[:, pages] = float("nan")

    def layer(self, i: int) -> torch.Tensor:
        """View [num_pages, page_size, D] of model layer i."""
        return self.data[self._lat[i]]

    def flat_layer(self, i: int) -> torch.Tensor:
        """View [num_pages * page_size, D] of model layer i (slot = page * page_size + offset)."""
        return self.data[self._lat[i]].view(-1, self.dim)

    def write(self, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` [k, D] at flat `slots` [k] of layer i."""
        if slots.numel():
            self.flat_layer(i).index_copy_(0, slots, rows.to(self.dtype))

    def read_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """Copies [L_s, len(pages), P, width] of some pages, one per store (latent first)."""
        return [t[:, pages] for t in self.tensors()]

    def write_pages(self, pages: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        for t, b in zip(self.tensors(), blocks):
            t[:, pages] = b.to(self.device, self.dtype)
