"""ForwardContext: what one rank's layers need to run one step (see docs/runtime.md).

Plain data, owned by the model: row ranges, this rank's page table per slice, the pool slots new tokens
are written to on this rank, and (lazily) the slots and positions of the keys this rank holds. What the
model calls on the step's attention layout and on a DSA step's selections is named by two small
Protocols here (`StepLayout`, `StepSparse`), so the model imports no attention code: the layouts
(splash/attention/) implement them. The per-rank runner builds a context once per step from the plan
(splash/worker/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from splash.core.layouts import DEFAULT_PAGE_SIZE
from splash.kv.pool import key_slots

if TYPE_CHECKING:
    from splash.kv.pool import KVPool
    from splash.kv.state import StateStep


class StepSparse(Protocol):
    """A DSA step's index rows and top-k selections, as a layer's forward drives them."""

    active: bool

    def begin(self, layer: int, rows: Any, ctx: ForwardContext) -> None:
        """Layer `layer` starts: its index rows (None: it shares the last full layer's selections)."""


class StepLayout(Protocol):
    """What a layer calls on the step's attention layout (splash/attention/base.py implements it)."""

    def attention(self, layer_idx: int, mla: torch.nn.Module, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        """-> [N, d]: an MLA layer's (splash/model/mla.py) attention output for every row of the step."""

    def linear_attention(self, layer_idx: int, kda: torch.nn.Module, x: torch.Tensor, ctx: ForwardContext
                         ) -> torch.Tensor:
        """-> [N, d]: a KDA layer's (splash/model/kda.py) output for every row of the step (hybrids)."""

    def sparse_step(self, topk: int, ctx: ForwardContext) -> StepSparse:
        """A DSA model's per-step selection state (made once per step, before the first layer)."""

    def index_rows(self, mla: torch.nn.Module, ctx: ForwardContext
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, positions) whose DSA indexer queries this rank scores this step; None: every row."""


class SliceCtx:
    """One request's rows in this step, with tensors on the model's device.

    `pages` is this rank's table (local page id of each global page, -1 where not held), a LongTensor;
    `all_pages` every rank's table as planned (Python lists) when the context was built from a plan's
    own tables (by hand, tests); empty when built from the rank's stored tables (the engine)."""

    __slots__ = ("req_id", "start", "num_new", "owner", "sample", "row_start", "all_pages", "page_size",
                 "_pages", "_table", "_keys", "slot")

    def __init__(self, req_id: int, start: int, num_new: int, owner: int, sample: bool, row_start: int,
                 pages: torch.Tensor | None = None, all_pages: list[list[int]] | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, *, table: tuple[torch.Tensor, int, int] | None = None,
                 slot: int = -1) -> None:
        if pages is None and table is None:
            raise ValueError("SliceCtx needs `pages` (or a row of a padded page table)")
        self.req_id, self.start, self.num_new, self.owner = req_id, start, num_new, owner
        self.sample, self.row_start, self.page_size = sample, row_start, page_size
        self.all_pages = all_pages if all_pages is not None else []
        self._pages = pages
        self._table = table  # (padded [B, W] table, row, length): `pages` is made from it on demand
        self._keys: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slot = slot  # the request's state slot (KDA models; -1 without per-request state)

    @property
    def pages(self) -> torch.Tensor:
        if self._pages is None:
            assert self._table is not None
            t, k, n = self._table
            self._pages = t[k, :n]
        return self._pages

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_new)

    def key_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat pool slots, positions) of this slice's keys held on this rank, up to `end`."""
        if self._keys is None:
            self._keys = key_slots(self.pages, self.end, self.page_size)
        return self._keys

    def __repr__(self) -> str:
        return (f"SliceCtx(req_id={self.req_id}, start={self.start}, num_new={self.num_new}, "
                f"owner={self.owner}, sample={self.sample}, row_start={self.row_start})")


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [N] absolute position of every row
    seqs: list[SliceCtx]
    kv: KVPool | None
    layout: StepLayout
    comm: Any = None
    rank: int = 0
    world: int = 1
    stats: dict[str, Any] = field(default_factory=dict)
    write_rows: torch.Tensor | None = None  # rows whose latent this rank stores ...
    write_slots: torch.Tensor | None = None  # ... and where (flat index into pool.layer(i).view(-1, D))
    page_table: torch.Tensor | None = None  # [B, W] this rank's tables of all slices, -1 padded
    max_end: int = 0  # longest context after this step (positions are all < max_end)
    page_size: int = DEFAULT_PAGE_SIZE
    all_held: bool = False  # this rank holds every page of every slice (write_rows is then all rows)
    sparse: StepSparse | None = None  # DSA models: the step's index rows and top-k selections
    state: StateStep | None = None  # KDA models: which rows read which state slot (splash/kv/state.py)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor of the step's plan on `dev`. CUDA: through pinned memory, without blocking the host
    (a copy from pageable memory synchronizes the stream, so the host could not run ahead of the GPU)."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)
