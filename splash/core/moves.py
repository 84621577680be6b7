"""The records of a switch manifest: the requests a switch moves, and what its manifest lists for them.

`splash.core.manifest` derives them from the holdings (`splash.core.holdings`); the switch planner and
executor (`splash.switch`) read them: per-state primitives and per-rank bytes (`StateManifest`,
`LayerManifest`), and the concrete moves and frees of weights (head runs), KV pages and per-request
state blocks, as records or, for the many pages and blocks of a large switch, as int64 arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.core.model_config import ConfigError

DISCARD, ALL_GATHER, ALL_TO_ALL, KEEP = "discard", "all-gather", "all-to-all", "keep"


@dataclass(frozen=True)
class Request:
    """One live request: its context length and its owner before and after the switch.

    `first_page`: the request's pages before it are another item's (prefix-cache pages it shares with
    a request listed earlier, SPEC §11): they are counted, moved and freed once, with that item, and
    this item covers global pages first_page .. ceil(context / P) - 1 (positions unchanged, so CP
    still places page j on rank j % T). A shared block needs its sharers on one owner in DP/DOP."""

    context: int
    owner_src: int = 0
    owner_dst: int | None = None
    first_page: int = 0

    @property
    def dst_owner(self) -> int:
        return self.owner_src if self.owner_dst is None else self.owner_dst


BatchItem = Request | int | tuple[int, ...]


def as_requests(batch: Iterable[BatchItem], ranks: int) -> list[Request]:
    """Accept Requests, (context, owner_src[, owner_dst]) tuples, or bare contexts (owner i % T)."""
    out: list[Request] = []
    for i, item in enumerate(batch):
        if isinstance(item, Request):
            r = item
        elif isinstance(item, (int, np.integer)):
            r = Request(int(item), i % ranks, i % ranks)
        else:
            t = tuple(map(int, item))
            r = Request(t[0], t[1] if len(t) > 1 else i % ranks, t[2] if len(t) > 2 else None,
                        t[3] if len(t) > 3 else 0)
        if r.context < 0:
            raise ConfigError(f"request {i}: context must be >= 0, got {r.context}")
        if r.first_page < 0:
            raise ConfigError(f"request {i}: first_page must be >= 0, got {r.first_page}")
        if not (0 <= r.owner_src < ranks and 0 <= r.dst_owner < ranks):
            o = r.dst_owner if 0 <= r.owner_src < ranks else r.owner_src
            raise ConfigError(f"request {i}: owner {o} is not a rank in [0, {ranks})")
        out.append(r)
    return out


# ---- concrete moves -------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightMove:
    """`dst` receives heads [start, stop) of projection `proj` from `src` (every layer alike)."""

    proj: str
    start: int
    stop: int
    src: int
    dst: int
    nbytes: float


@dataclass(frozen=True)
class WeightFree:
    rank: int
    proj: str
    start: int
    stop: int
    nbytes: float


@dataclass(frozen=True)
class PageMove:
    """`dst` receives global pages `pages` of request `request` (batch index) from `src`."""

    request: int
    pages: tuple[int, ...]
    src: int
    dst: int
    tokens: int
    nbytes: float  # per layer


@dataclass(frozen=True)
class PageFree:
    rank: int
    request: int
    pages: tuple[int, ...]
    tokens: int
    nbytes: float  # per layer


@dataclass(frozen=True)
class KVPages:
    """One layer's page moves and frees as flat int64 arrays, one row per page, in the order of
    `kv_moves()` / `kv_frees()`; `*_starts` are the rows where each PageMove / PageFree begins.

    A switch moves thousands of pages and the runtime planner checks every one on the switching
    step's critical path: arrays spare it a Python object per page.
    """

    moves: np.ndarray  # [k, 4]: request, global page, sender, receiver
    move_starts: np.ndarray  # [number of PageMoves]
    frees: np.ndarray  # [f, 3]: request, global page, rank
    free_starts: np.ndarray  # [number of PageFrees]

    @classmethod
    def of(cls, moves: Sequence[PageMove], frees: Sequence[PageFree]) -> KVPages:
        """From listed moves and frees (hand-made manifests in tests)."""
        mv = [(m.request, p, m.src, m.dst) for m in moves for p in m.pages]
        fr = [(f.request, p, f.rank) for f in frees for p in f.pages]
        return cls(np.array(mv, dtype=np.int64).reshape(-1, 4), _starts([len(m.pages) for m in moves]),
                   np.array(fr, dtype=np.int64).reshape(-1, 3), _starts([len(f.pages) for f in frees]))


def _starts(lengths: Sequence[int]) -> np.ndarray:
    return (np.cumsum(lengths, dtype=np.int64) - np.asarray(lengths, dtype=np.int64)).reshape(-1)


@dataclass(frozen=True)
class StateManifest:
    """One state (weights or KV) of one layer: its primitive and per-rank byte counts."""

    state: str
    primitive: str
    recv_bytes: tuple[float, ...]
    send_bytes: tuple[float, ...]
    freed_bytes: tuple[float, ...]

    @property
    def bytes_per_rank(self) -> float:
        """The busiest rank's received bytes: what bounds the collective's time."""
        return max(self.recv_bytes, default=0.0)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.recv_bytes))

    @property
    def moves_network(self) -> bool:
        return self.total_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "bytes_per_rank": self.bytes_per_rank,
                "bytes_group": self.total_bytes, "recv_bytes": list(self.recv_bytes),
                "freed_bytes": list(self.freed_bytes)}


@dataclass(frozen=True)
class LayerManifest:
    """One layer's manifest: an MLA layer's weights and KV, or a KDA layer's weights and per-request
    state (its `kv` then moves nothing: a KDA layer has no pages)."""

    layer: int
    weights: StateManifest
    kv: StateManifest
    kind: str = "mla"
    state: StateManifest | None = None

    @property
    def recv_bytes(self) -> np.ndarray:
        out = np.asarray(self.weights.recv_bytes) + np.asarray(self.kv.recv_bytes)
        return out if self.state is None else out + np.asarray(self.state.recv_bytes)


@dataclass(frozen=True)
class StateMove:
    """`dst` receives heads [start, stop) of request `request`'s KDA state from `src` (per KDA layer)."""

    request: int
    start: int
    stop: int
    src: int
    dst: int
    nbytes: float


@dataclass(frozen=True)
class StateFree:
    rank: int
    request: int
    start: int
    stop: int
    nbytes: float


@dataclass(frozen=True)
class StateBlocks:
    """One KDA layer's state moves and frees as int64 arrays, one row per (request, head) block:
    moves [k, 4] (request, head, sender, receiver), frees [f, 3] (request, head, rank); rows sorted by
    (request, receiver, sender, head) and (request, rank, head)."""

    moves: np.ndarray
    frees: np.ndarray


# ---- the array forms: rows grouped into records, per-rank totals ---------------------------------
EMPTY_ROWS = np.zeros(0, dtype=np.int64)
EMPTY_ROWS.setflags(write=False)


def grouped_rows(keys: np.ndarray, columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `columns` stably sorted by `keys`, and where each run of equal keys starts."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1]))) if k.size else k
    rows = np.empty((len(keys), len(columns)), dtype=np.int64)
    for c, col in enumerate(columns):
        rows[:, c] = col[order]
    return rows, starts


def row_runs(pages: np.ndarray, tok: np.ndarray, starts: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """Pages and token totals of each run of rows (a PageMove or PageFree each)."""
    bounds = np.append(starts, len(pages)).tolist()
    flat = pages.tolist()
    csum = np.concatenate(([0], np.cumsum(tok))).tolist()
    return ([flat[a:b] for a, b in zip(bounds, bounds[1:])],
            [csum[b] - csum[a] for a, b in zip(bounds, bounds[1:])])


def tokens_per_rank(rank: np.ndarray, tokens: np.ndarray, ranks: int) -> np.ndarray:
    """Tokens summed per rank, as float64 (np.bincount of nothing is int64 even with weights)."""
    if not len(rank):
        return np.zeros(ranks)
    return np.bincount(rank, weights=tokens, minlength=ranks).astype(np.float64)
