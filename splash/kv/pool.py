"""One rank's paged KV pool: the latent tensor [L, num_pages, page_size, d_c + d_r] and a sibling tensor
per other per-token store (the DSA indexer's keys, [L_I, num_pages, page_size, index_head_dim]).

Each token's latent entry per layer is the normed `c_kv` followed by the roped `k_pe` (absorbed MLA
needs nothing else). Every per-token store of `splash.core.stores` shares the latent's page ids: a page
id names the same positions in each, so one allocator, one page table and one switch manifest serve
them all, and a page's bytes are the sum of its stores' (`bytes_per_page`). The pool only stores;
which pages belong to which request is the allocator's job (`splash/kv/allocator.py`, on rank 0), and
the step plan's page tables say where rows go.

Each store keeps its rows in its element format (`--kv-cache-dtype`, `splash/kv/codec.py`): `dtype` is
the model's (what `write` takes and `gather` returns), a store's tensor holds `codec.row` elements of
`codec.storage` a token (bytes for FP8). Kernels read the raw rows (`layer`, `store_flat`) and decode
where they use them; switches and swaps move raw rows (`read_rows`, `read_pages`), never re-encoding.
"""

from __future__ import annotations

import torch

from splash.core.layouts import DEFAULT_PAGE_SIZE
from splash.core.model_config import ConfigError, ModelConfig, dtype_name
from splash.core.sizes import kv_bytes_per_token
from splash.core.stores import Part, kv_format, token_stores
from splash.kv.codec import Codec


def format_of(fmt: str | None, dtype: torch.dtype) -> str:
    """The pool's element format: `fmt` as resolved once on rank 0 (`RuntimeSpec.kv_format`: "auto" is
    never seen here), or None for the plain format of `dtype` (pools made by hand in tests, benchmarks)."""
    if fmt == "auto":
        raise ValueError("the KV element format 'auto' is resolved once (splash.engine.resolve."
                         "element_format); pass the resolved format")
    return dtype_name(dtype) if fmt is None else kv_format(fmt)


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
                 latent_layers: tuple[int, ...] | None = None, codecs: dict[str, Codec] | None = None,
                 fmt: str | None = None) -> None:
        if num_pages < 1 or page_size < 1:
            raise ConfigError(f"KV pool needs at least one page of at least one token "
                              f"(got {num_pages} pages of {page_size})")
        if latent_layers is not None and len(latent_layers) != num_layers:
            raise ValueError(f"{num_layers} latent layers but {len(latent_layers)} layer ids given")
        self.num_layers, self.num_pages, self.page_size, self.dim = num_layers, num_pages, page_size, dim
        self.latent_layers = tuple(range(num_layers)) if latent_layers is None else tuple(latent_layers)
        self._lat = {layer: k for k, layer in enumerate(self.latent_layers)}
        self.dtype = dtype  # the model's: what `write` takes and `gather` returns
        self.device = torch.device(device or "cpu")
        self.fmt = fmt or dtype_name(dtype)  # the element format's name (core's)
        if codecs is None:  # a pool built by hand: every store plain, in the model's dtype
            widths = {"latent": dim, **{n: w for n, (_, w) in (extra or {}).items()}}
            codecs = {n: Codec((Part(w, self.fmt),), w, dtype) for n, w in widths.items()}
        self.codecs: dict[str, Codec] = codecs
        self.tensor_scale: dict[int, float] = {}  # fp8_e4m3: a layer's scale (checkpoint k_scale), else 1
        lat = self.codecs["latent"]
        self.data = torch.zeros(num_layers, num_pages, page_size, lat.row, dtype=lat.storage,
                                device=self.device)
        # name -> [len(layers), num_pages, page_size, row]; row of layer i in `_rows[name][i]`
        self.extra: dict[str, torch.Tensor] = {}
        self._rows: dict[str, dict[int, int]] = {}
        self._widths: dict[str, int] = {}
        for name, (layers, width) in (extra or {}).items():
            self.extra[name] = torch.zeros(len(layers), num_pages, page_size, self.codecs[name].row,
                                           dtype=self.storage, device=self.device)
            self._rows[name] = {layer: k for k, layer in enumerate(layers)}
            self._widths[name] = width

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None, kv_cache_dtype: str | None = None) -> KVPool:
        """A pool holding every per-token store of `cfg` (the latent, and the indexer keys of a DSA model)
        in the element format `kv_cache_dtype` (resolved; None: the plain format of `dtype`)."""
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
        fmt = format_of(kv_cache_dtype, dtype)
        check_format(cfg, fmt)
        codecs = {s.name: Codec.of(cfg, s, fmt, dtype) for s in ts if not s.base}
        return cls(len(lat), num_pages, page_size, cfg.latent_dim, dtype, device, extra, latent_layers=lat,
                   codecs=codecs, fmt=fmt)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype, kv_cache_dtype: str | None = None
                       ) -> int:
        """Bytes one page takes over every layer and per-token store: the analytical core's
        `kv_bytes_per_token` in the pool's element format, times the page size (one rule)."""
        return int(page_size * kv_bytes_per_token(cfg, format_of(kv_cache_dtype, dtype)))

    @classmethod
    def pages_for_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype,
                         kv_cache_dtype: str | None = None) -> int:
        return int(budget_bytes // cls.bytes_per_page(cfg, page_size, dtype, kv_cache_dtype))

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int = DEFAULT_PAGE_SIZE,
                    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    kv_cache_dtype: str | None = None) -> KVPool:
        """As many whole pages as `budget_bytes` holds (all layers of a token count together)."""
        n = cls.pages_for_budget(cfg, budget_bytes, page_size, dtype, kv_cache_dtype)
        if n < 1:
            need = cls.bytes_per_page(cfg, page_size, dtype, kv_cache_dtype)
            raise ConfigError(f"a KV budget of {budget_bytes} bytes holds no page ({need} bytes per page of "
                              f"{page_size} tokens); raise --memory-per-rank or lower the page size")
        return cls.for_model(cfg, n, page_size, dtype, device, kv_cache_dtype)

    @property
    def storage(self) -> torch.dtype:
        """The dtype every store's tensor has (one element format per pool; bytes for FP8)."""
        return self.data.dtype

    def _encode(self, name: str, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Model-dtype rows [k, width] of store `name` in layer i -> stored rows (FP8: quantised)."""
        codec = self.codecs[name]
        if not codec.packed:
            return rows.to(self.storage)
        return codec.encode(rows.to(self.dtype), self.tensor_scale.get(i, 1.0) if name == "latent" else 1.0)

    @property
    def packed(self) -> bool:
        """Whether rows are kept as bytes of a packed (FP8) format rather than values."""
        return self.codecs["latent"].packed

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
        return self.extra[name][self._rows[name][i]].view(-1, self.codecs[name].row)

    def write_store(self, name: str, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` [k, width] (the model's values) at flat `slots` [k] of store `name` in layer i,
        encoded in the pool's element format (FP8: quantised per token, here and only here)."""
        if name == "latent":
            return self.write(i, slots, rows)
        if slots.numel():
            enc = self._encode(name, i, rows)
            self.store_flat(name, i).index_copy_(0, slots, enc)

    def gather_store(self, name: str, i: int, slots: torch.Tensor) -> torch.Tensor:
        """The model-dtype values [*slots.shape, width] of store `name` in layer i at flat `slots`."""
        if name == "latent":
            return self.gather(i, slots)
        return self.codecs[name].decode(self.store_flat(name, i)[slots])

    def gather(self, i: int, slots: torch.Tensor) -> torch.Tensor:
        """The latent values [*slots.shape, D] of layer i at flat `slots`, in the model's dtype."""
        return self.decode(i, self.flat_layer(i)[slots])

    def decode(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Stored latent rows [..., row] of layer i (raw, as gathered by a kernel's torch path) -> values."""
        if not self.packed and rows.dtype == self.dtype:
            return rows
        return self.codecs["latent"].decode(rows, self.tensor_scale.get(i, 1.0))

    def as_stored(self, i: int, rows: torch.Tensor, name: str = "latent") -> torch.Tensor:
        """Rows [k, width] of store `name` as layer i would give them back once written (an FP8 cache's
        round trip; the rows themselves for the model's dtype): for a path that attends new rows
        without reading the pool, so that it sees what every other layout reads."""
        if name != "latent":
            return self.codecs[name].decode(self._encode(name, i, rows))
        if not self.packed and self.storage == self.dtype:
            return rows
        return self.decode(i, self._encode("latent", i, rows))

    def kernel_format(self, i: int) -> tuple[int, float] | None:
        """What a paged kernel is told about layer i's latent rows (`native.paged_attention`'s `fmt`):
        (0, 1) values of the model's dtype, (1, scale) fp8_e4m3, (2, 1) fp8_ds_mla, (3, 1) BF16 values
        under a float32/float64 model; None: another plain mix (the torch path decodes it)."""
        lat = self.codecs["latent"]
        if not lat.packed:
            if self.storage == self.dtype:
                return (0, 1.0)
            wide = self.dtype in (torch.float32, torch.float64)
            return (3, 1.0) if self.storage == torch.bfloat16 and wide else None
        return (lat.kernel_format, self.tensor_scale.get(i, 1.0))

    def _extra_of(self, i: int) -> list[tuple[str, int]]:
        """(name, width) of the stores beside the latent that layer i has, in pool order."""
        return [(n, self._widths[n]) for n in self.extra if i in self._rows[n]]

    def layer_width(self, i: int) -> int:
        """Stored elements per token of layer i over every per-token store (what a switch moves per
        token: values of a plain format, bytes of a packed one)."""
        return self.codecs["latent"].row + sum(self.codecs[n].row for n, _ in self._extra_of(i))

    def read_rows(self, i: int, slots: torch.Tensor) -> torch.Tensor:
        """[k, layer_width(i)]: every store's stored rows of layer i at `slots`, side by side (latent
        first), as they are in the pool (FP8 bytes stay bytes)."""
        parts = [self.flat_layer(i).index_select(0, slots)]
        parts += [self.store_flat(n, i).index_select(0, slots) for n, _ in self._extra_of(i)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def write_rows(self, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of `read_rows`: stored rows [k, layer_width(i)] copied back into the stores of
        layer i unchanged (no re-encoding)."""
        if not slots.numel():
            return
        rows = rows.to(self.storage)
        at = self.codecs["latent"].row
        self.flat_layer(i).index_copy_(0, slots, rows[:, :at])
        for n, _ in self._extra_of(i):
            w = self.codecs[n].row
            self.store_flat(n, i).index_copy_(0, slots, rows[:, at:at + w])
            at += w

    def release(self) -> tuple[torch.Size, ...]:
        """Free every store's memory (shapes returned for `restore`)."""
        shapes = tuple(t.shape for t in self.tensors())
        self.data = torch.empty(0, dtype=self.storage, device=self.device)
        self.extra = {n: torch.empty(0, dtype=self.storage, device=self.device) for n in self.extra}
        return shapes

    def restore(self, shapes: tuple[torch.Size, ...]) -> None:
        """Zeroed stores of the shapes `release` returned."""
        self.data = torch.zeros(shapes[0], dtype=self.storage, device=self.device)
        self.extra = {n: torch.zeros(sh, dtype=self.storage, device=self.device)
                      for n, sh in zip(self.extra, shapes[1:])}

    def poison(self, pages: torch.Tensor) -> None:
        """Debug aid: NaN into `pages` of every store, so a later read of them shows in the logits (all
        bits set in a packed store: NaN as FP8, as its float32 scales and as BF16)."""
        for t in self.tensors():
            t[:, pages] = 255 if t.dtype == torch.uint8 else float("nan")

    def layer(self, i: int) -> torch.Tensor:
        """View [num_pages, page_size, row] of model layer i's stored latent rows (the kernels' input)."""
        return self.data[self._lat[i]]

    def flat_layer(self, i: int) -> torch.Tensor:
        """View [num_pages * page_size, row] of model layer i's stored rows (slot = page * P + offset);
        the values themselves when the format is the model's dtype (else `gather`)."""
        return self.data[self._lat[i]].view(-1, self.data.shape[-1])

    def write(self, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` [k, D] (the model's values) at flat `slots` [k] of layer i, encoded."""
        if slots.numel():
            self.flat_layer(i).index_copy_(0, slots, self._encode("latent", i, rows))

    def read_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """Copies [L_s, len(pages), P, width] of some pages, one per store (latent first)."""
        return [t[:, pages] for t in self.tensors()]

    def write_pages(self, pages: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        for t, b in zip(self.tensors(), blocks):
            t[:, pages] = b.to(self.device, self.storage)


def check_format(cfg: ModelConfig, fmt: str) -> None:
    """Refuse, with what to do, an element format that does not fit the model."""
    if fmt in ("fp8_e4m3", "fp8_ds_mla") and cfg.kv_lora_rank < 1:
        raise ConfigError(f"--kv-cache-dtype {fmt} needs an MLA latent (kv_lora_rank); use auto")
