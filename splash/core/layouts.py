"""The ownership model (paper §2): a layout = projection placement x KV ownership.

| layout | projections (Q-B, KV-B, O) | each request's latent KV |
|--------|----------------------------|--------------------------|
| TP     | sharded by heads           | replicated on every rank |
| DP     | replicated                 | on one owner rank        |
| CP     | replicated                 | sharded by position      |
| DOP    | sharded by heads           | on one owner rank        |

Everything else (footprints, manifests, capacity) is derived from these two choices, so a new
layout is a new row here. So is where a per-request state with heads (a KDA layer's recurrent and conv
states, SPEC §10) lives, `Layout.state_placement`: head-sharded where the projections are (TP, DOP: a
rank updates the heads it projects, for every request), else on the owner (DP), else on every rank
(CP, whose ranks all compute every row's KDA redundantly: replicated).

Footprints take arbitrary, unbalanced contexts and owners; the balanced
formulas of Eq 1 and the busiest-rank loads of Table 2 are special cases checked in the tests.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import numpy as np

from splash.core.model_config import ConfigError, head_slice

# Tokens per KV page: the one default of the runtime (`EngineConfig.page_size`) and of every core
# function that counts pages. The paper's analyses use 64 (`PAPER_PAGE_SIZE`): the paper-scale commands
# (`splash plan`, `splash simulate`) pass it explicitly.
DEFAULT_PAGE_SIZE = 16
PAPER_PAGE_SIZE = 64


class Placement(enum.Enum):
    SHARDED = "sharded"
    REPLICATED = "replicated"


class Ownership(enum.Enum):
    REPLICATED = "replicated"  # every rank holds every page (TP)
    OWNER = "owner"  # one owner rank holds the whole history (DP, DOP)
    POSITION = "position"  # global page j of a request lives on rank j % T (CP)


class StatePlacement(enum.Enum):
    HEAD_SHARDED = "head-sharded"  # rank r holds its head slice of every request's state (TP, DOP)
    OWNER = "owner"  # the request's owner holds it whole (DP)
    REPLICATED = "replicated"  # every rank holds it whole (CP)


class Layout(enum.Enum):
    TP = "tp"
    DP = "dp"
    CP = "cp"
    DOP = "dop"

    @property
    def label(self) -> str:
        return self.name

    @property
    def placement(self) -> Placement:
        return _PLACEMENT[self]

    @property
    def ownership(self) -> Ownership:
        return _OWNERSHIP[self]

    @property
    def state_placement(self) -> StatePlacement:
        """Where a per-request state with heads lives: derived from the projection placement (sharded
        -> head-sharded) and, for replicated projections, the KV ownership (owner -> owner, else every
        rank). The one statement of the rule; `stores.state_share` makes it concrete per rank."""
        if self.sharded:
            return StatePlacement.HEAD_SHARDED
        return StatePlacement.OWNER if self.owned else StatePlacement.REPLICATED

    @property
    def sharded(self) -> bool:
        return self.placement is Placement.SHARDED

    @property
    def owned(self) -> bool:
        """Whether each request has one owner rank holding its whole history (DP, DOP)."""
        return self.ownership is Ownership.OWNER

    def heads(self, rank: int, ranks: int, heads: int) -> range:
        """Heads whose projection slices `rank` holds: its 1/T slice if sharded (and T > 1), else all."""
        return head_slice(heads, rank, ranks) if self.sharded and ranks > 1 else range(heads)

    def page_ranks(self, j: int, owner: int, ranks: int) -> tuple[int, ...]:
        """Ranks that store global page `j` of a request owned by `owner` (the ownership made concrete:
        every rank, the owner, or rank j % T). `holdings.held_columns` is the same rule over arrays."""
        own = self.ownership
        if own is Ownership.REPLICATED:
            return tuple(range(ranks))
        if own is Ownership.OWNER:
            return (owner,)
        return (j % ranks,)

    def distinct(self, per_rank: Sequence[int]) -> int:
        """How per-rank KV pools count as distinct tokens (or pages) of the group: replicated KV is
        bounded by the smallest rank's pool, the other ownerships add the pools up."""
        return min(per_rank) if self.ownership is Ownership.REPLICATED else sum(per_rank)

    @classmethod
    def named(cls, name: str | Layout) -> Layout:
        """The layout of a runtime name ("tp", exactly as plans, allocators and flags carry it);
        ValueError (one line, with the choices) for anything else. `parse` is the lenient reading of
        what a user typed."""
        if isinstance(name, Layout):
            return name
        found = _BY_NAME.get(name)  # type: ignore[arg-type]
        if found is None:
            raise ValueError(f"unknown layout {name!r}; expected one of {', '.join(_BY_NAME)}")
        return found

    @classmethod
    def parse(cls, name: str | Layout) -> Layout:
        """'TP', 'dp', 'DP-attention', 'dop' ... -> Layout; ConfigError names the choices."""
        if isinstance(name, Layout):
            return name
        key = str(name).strip().lower().replace("_", "-")
        key = {"dp-attention": "dp", "dp-attn": "dp", "dpa": "dp"}.get(key, key)
        for lay in cls:
            if lay.value == key:
                return lay
        raise ConfigError(f"unknown layout {name!r}; choose one of TP, DP, CP, DOP")


_PLACEMENT = {Layout.TP: Placement.SHARDED, Layout.DP: Placement.REPLICATED,
              Layout.CP: Placement.REPLICATED, Layout.DOP: Placement.SHARDED}
_OWNERSHIP = {Layout.TP: Ownership.REPLICATED, Layout.DP: Ownership.OWNER,
              Layout.CP: Ownership.POSITION, Layout.DOP: Ownership.OWNER}
LAYOUTS: tuple[Layout, ...] = (Layout.TP, Layout.DP, Layout.CP, Layout.DOP)
_BY_NAME = {lay.value: lay for lay in LAYOUTS}
LAYOUT_NAMES: tuple[str, ...] = tuple(_BY_NAME)  # the runtime's names ("tp", "dp", "cp", "dop"): flags, plans
DIRECTIONS: tuple[tuple[Layout, Layout], ...] = tuple((a, b) for a in LAYOUTS for b in LAYOUTS if a != b)


def state_placement(layout: Layout | str) -> str:
    """"head-sharded", "owner" or "replicated": where `layout` keeps each request's KDA state (what the
    runtime asks instead of testing layout names)."""
    return Layout.parse(layout).state_placement.value


def parse_layouts(spec: str) -> list[Layout]:
    """'TP,DP,dop' -> [Layout.TP, Layout.DP, Layout.DOP]."""
    return [Layout.parse(x) for x in spec.split(",") if x.strip()]


def round_robin_owners(n: int, ranks: int) -> list[int]:
    """Count-balanced, length-blind owners (appendix B.1): request i -> rank i mod T."""
    return [i % ranks for i in range(n)]


def token_split(rows: int, ranks: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """CP's split of a prefill chunk's query rows over the ranks (as SGLang's prefill CP splits a
    prompt): 2T contiguous pieces, rank j computing the j-th and the (2T-1-j)-th, so an early (cheap,
    few keys) piece goes with a late (costly) one and causal work is even. -> per rank its two
    [lo, hi) row ranges within the chunk."""
    b = [rows * i // (2 * ranks) for i in range(2 * ranks + 1)]
    return [((b[j], b[j + 1]), (b[2 * ranks - 1 - j], b[2 * ranks - j])) for j in range(ranks)]


def check_batch(contexts: Sequence[int], owners: Sequence[int] | None,
           ranks: int) -> tuple[np.ndarray, np.ndarray]:
    if ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {ranks}")
    s = np.asarray(contexts, dtype=np.int64).reshape(-1)
    if (s < 0).any():
        raise ConfigError("context lengths must be >= 0")
    o = np.asarray(round_robin_owners(len(s), ranks) if owners is None else owners, dtype=np.int64)
    if o.shape != s.shape:
        raise ConfigError(f"{len(o)} owners given for {len(s)} requests")
    if len(o) and (o.min() < 0 or o.max() >= ranks):
        raise ConfigError(f"owners must lie in [0, {ranks})")
    return s, o


def position_shard_tokens(contexts: np.ndarray, ranks: int, page_size: int | None) -> np.ndarray:
    """Tokens each rank stores under CP: page j of every request on rank j % T ([T] array).

    `page_size=None` means ideal token-level balance (the capacity simulation's assumption).
    """
    P = 1 if page_size is None else int(page_size)
    full, rem = contexts // P, contexts % P
    r = np.arange(ranks)[:, None]
    tokens = (full[None, :] // ranks + (r < (full % ranks)[None, :])) * P
    tokens = tokens + np.where(r == (full % ranks)[None, :], rem[None, :], 0)
    return tokens.sum(axis=1)


def kv_tokens_per_rank(layout: Layout, contexts: Sequence[int], owners: Sequence[int] | None,
                       ranks: int, page_size: int | None = None) -> np.ndarray:
    """Context tokens of latent KV each rank stores in `layout` ([T] int array)."""
    s, o = check_batch(contexts, owners, ranks)
    own = layout.ownership
    if own is Ownership.REPLICATED:
        return np.full(ranks, int(s.sum()), dtype=np.int64)
    if own is Ownership.OWNER:
        return np.bincount(o, weights=s, minlength=ranks).astype(np.int64)
    return position_shard_tokens(s, ranks, page_size)


def kv_pages_per_rank(layout: Layout, contexts: Sequence[int], owners: Sequence[int] | None,
                      ranks: int, page_size: int) -> np.ndarray:
    """Pages each rank must allocate (a partly filled last page still costs a page)."""
    s, o = check_batch(contexts, owners, ranks)
    n = -(-s // page_size)
    own = layout.ownership
    if own is Ownership.REPLICATED:
        return np.full(ranks, int(n.sum()), dtype=np.int64)
    if own is Ownership.OWNER:
        return np.bincount(o, weights=n, minlength=ranks).astype(np.int64)
    r = np.arange(ranks)[:, None]
    return (n[None, :] // ranks + (r < (n % ranks)[None, :])).sum(axis=1)


def state_requests_per_rank(layout: Layout, owners: Sequence[int] | np.ndarray, ranks: int) -> np.ndarray:
    """Sum over requests of g, the share of each request's per-request state a rank holds ([T] float):
    B/T everywhere when head-sharded, each owner's count in DP, B on every rank in CP."""
    o = np.asarray(owners, dtype=np.int64).reshape(-1)
    kind = layout.state_placement
    if kind is StatePlacement.HEAD_SHARDED:
        return np.full(ranks, len(o) / ranks)
    if kind is StatePlacement.OWNER:
        return np.bincount(o, minlength=ranks).astype(np.float64)
    return np.full(ranks, float(len(o)))


def balanced_footprint(layout: Layout, w_a: float, k: float, batch: int, context: float,
                       ranks: int, replicated: float = 0.0, z: float = 0.0) -> float:
    """Eq 1 as printed (T divides B): the per-rank bytes of B requests of context s; `replicated`:
    attention weights every layout replicates (a DSA model's indexer projections); `z`: per-request
    state bytes (a hybrid's KDA states), the busiest rank holding B*z*g (`state_histories_busiest`)."""
    w = (w_a / ranks if layout.sharded else w_a) + replicated
    kv = batch * k * context
    kv = kv if layout.ownership is Ownership.REPLICATED else kv / ranks
    return w + kv + (z * state_histories_busiest(layout, batch, ranks) if z else 0.0)


def busiest_rank_load(layout: Layout, batch: int, ranks: int) -> dict[str, float]:
    """Table 2: busiest-rank load for B equal requests (count-balanced owners, ideal CP).

    `weights` is the fraction of W_A held; the KV columns count histories of k*s bytes; attention
    work counts one request's attention over all heads. A hybrid's KDA layers add `state_stored`
    (request states of z bytes held, the sum of g) and `kda` (one request's KDA work over all heads:
    TP/DOP each rank its heads of every row, DP the owner's rows, CP every row on every rank).
    """
    owned = math.ceil(batch / ranks)
    row = {
        Layout.TP: {"weights": 1 / ranks, "kv_stored": batch, "kv_read": batch, "attention": batch / ranks},
        Layout.CP: {"weights": 1.0, "kv_stored": batch / ranks, "kv_read": batch / ranks,
                    "attention": batch / ranks},
        Layout.DP: {"weights": 1.0, "kv_stored": owned, "kv_read": owned, "attention": owned},
        Layout.DOP: {"weights": 1 / ranks, "kv_stored": owned, "kv_read": owned, "attention": owned},
    }[layout]
    state = state_histories_busiest(layout, batch, ranks)
    return {**row, "state_stored": state, "kda": state}


def state_histories_busiest(layout: Layout, batch: int, ranks: int) -> float:
    """Request states (of z bytes) the busiest rank holds: B/T head-sharded, ceil(B/T) on a DP owner
    (count-balanced owners), B replicated. The KDA work per rank is the same count."""
    kind = layout.state_placement
    if kind is StatePlacement.HEAD_SHARDED:
        return batch / ranks
    if kind is StatePlacement.OWNER:
        return float(math.ceil(batch / ranks))
    return float(batch)


def kv_histories_busiest(layout: Layout, batch: int, ranks: int) -> float:
    """Histories the busiest rank stores: the `kv_stored` column of Table 2."""
    return busiest_rank_load(layout, batch, ranks)["kv_stored"]


def longest_balanced_context(layout: Layout, mem_avail: float, w_a: float, k: float, batch: int,
                             ranks: int, replicated: float = 0.0, z: float = 0.0) -> float:
    """Longest context s of B equal requests whose busiest rank fits `mem_avail` bytes (>= 0).

    With T | B this is Eq 1 solved for s: DOP (T*M - W_A)/(B*k), DP/CP T*(M - W_A)/(B*k),
    TP (M - W_A/T)/(B*k); otherwise the owner layouts use ceil(B/T) histories. `replicated`: attention
    weights every layout holds whole (a DSA model's indexer projections), taken from M first; `z`:
    per-request state bytes (a hybrid's), the busiest rank's share of them taken too.
    """
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    w = (w_a / ranks if layout.sharded else w_a) + replicated
    free = mem_avail - w - (z * state_histories_busiest(layout, batch, ranks) if z else 0.0)
    if free <= 0:
        return 0.0
    return free / (k * kv_histories_busiest(layout, batch, ranks))
