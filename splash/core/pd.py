"""The prefill-to-decode transfer as a cross-group switch (issue 47): which prefill rank sends which
blocks of one request to which decode rank.

A switch inside one group is the per-rank set difference of what a rank holds and what the destination
needs (SPEC Eq 2, `splash.core.manifest`). A disaggregated transfer is the same question across two
groups: the prefill group holds the request in its layout a on T_p ranks, the decode group needs it in
its layout b on T_d ranks, and every decode rank starts with nothing. The blocks are the holdings'
(`splash.core.holdings`): global page j of the request (every per-token store, every layer: the stores
share page ids) and one head of each per-request store (a KDA hybrid's recurrent and conv states).

Rules, so that each needed block crosses the link once:
- the receiver: a block that one decode rank needs goes to it; a block that several need (TP pages, CP's
  replicated KDA state) goes over the link to ONE of them, its PART's rank (page j to rank j % T_d, head
  h to the rank whose head slice has it: the receiving load spread over the group), and `fill_pages` /
  `fill_states` copy it to the others inside the decode group (a local, fast link). With `fill=False`
  every needer receives its own copy over the link (what an engine without the inner copy does).
- the sender: a block held by one prefill rank (DP/DOP owner, CP position, TP/DOP head slice) is sent by
  that rank; a replicated one (TP pages, CP state) by its PART's rank on the prefill side (page j by
  rank j % T_p), which spreads the sending load over the replicas.
Bytes come from the store table (`splash.core.stores`), so they equal the runtime's tensors: a page is
`store_row_bytes x page_size x layers` summed over the per-token stores, a head of a per-request store
its `store_request_bytes / heads` over its layers. `blind_bytes` is the layout-blind baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from splash.core.holdings import head_parts, held_columns, page_parts
from splash.core.layouts import Layout, Ownership
from splash.core.model_config import ConfigError, ModelConfig
from splash.core.sizes import head_runs
from splash.core.stores import (
    Store,
    act_dtype,
    request_stores,
    state_share,
    store_request_bytes,
    store_row_bytes,
    token_stores,
)
from splash.core.stores import kv_format as format_name


@dataclass(frozen=True)
class Group:
    """One side of the split: its layout on `ranks` ranks; `owner`: the request's owner rank (DP/DOP;
    ignored by TP/CP). A layout name ("tp", "DP-attention", ...) is accepted for `layout`."""

    layout: Layout
    ranks: int
    owner: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            object.__setattr__(self, "layout", Layout.parse(self.layout))
        if self.ranks < 1:
            raise ConfigError(f"a group needs at least one rank, got {self.ranks}")
        if not 0 <= self.owner < self.ranks:
            raise ConfigError(f"owner rank {self.owner} is outside the group's ranks 0..{self.ranks - 1}")

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.label, "ranks": self.ranks, "owner": self.owner}


@dataclass(frozen=True)
class PageMove:
    """Global page `page` (every per-token store, every layer) from rank `src` to rank `dst`."""

    page: int
    src: int
    dst: int


@dataclass(frozen=True)
class StateMove:
    """Heads [h0, h1) (global head ids) of per-request store `store`, every layer of it, src -> dst."""

    store: str
    h0: int
    h1: int
    src: int
    dst: int


@dataclass(frozen=True)
class PDManifest:
    """One request's transfer: the link moves (src = prefill rank, dst = decode rank), the fill moves
    inside the decode group (src, dst = decode ranks), and their bytes."""

    src: Group
    dst: Group
    context: int  # tokens of the request's prompt (pages = ceil(context / page_size))
    page_size: int
    pages: tuple[PageMove, ...]  # over the link
    states: tuple[StateMove, ...]  # over the link
    fill_pages: tuple[PageMove, ...]  # inside the decode group: replicas completed
    fill_states: tuple[StateMove, ...]  # likewise for per-request state
    page_bytes: int  # one page over every per-token store and layer (whole pages move)
    head_bytes: dict[str, int]  # one head of each per-request store over all its layers
    link_bytes: int  # bytes that cross between the groups
    send: tuple[int, ...]  # per prefill rank: bytes it sends over the link
    recv: tuple[int, ...]  # per decode rank: bytes it receives (link + fill)
    fill_bytes: int  # bytes moved inside the decode group
    note: str

    @property
    def num_pages(self) -> int:
        return -(-self.context // self.page_size)

    def move_bytes(self, move: PageMove | StateMove) -> int:
        """Bytes one move carries."""
        if isinstance(move, PageMove):
            return self.page_bytes
        return self.head_bytes[move.store] * (move.h1 - move.h0)

    @property
    def link_recv(self) -> tuple[int, ...]:
        """Per decode rank: bytes it receives over the link (the rest of `recv` is fill)."""
        out = [0] * self.dst.ranks
        for m in (*self.pages, *self.states):
            out[m.dst] += self.move_bytes(m)
        return tuple(out)

    @property
    def fill_send(self) -> tuple[int, ...]:
        """Per decode rank: bytes it sends to the others inside the decode group."""
        out = [0] * self.dst.ranks
        for m in (*self.fill_pages, *self.fill_states):
            out[m.src] += self.move_bytes(m)
        return tuple(out)

    def to_json(self, moves: bool = False) -> dict[str, Any]:
        """The bytes (and with `moves`, every move as [page, src, dst] / [store, h0, h1, src, dst])."""
        out: dict[str, Any] = {
            "prefill": self.src.to_json(), "decode": self.dst.to_json(), "context": self.context,
            "page_size": self.page_size, "pages": self.num_pages, "page_bytes": self.page_bytes,
            "head_bytes": dict(self.head_bytes), "link_bytes": self.link_bytes, "fill_bytes": self.fill_bytes,
            "send": list(self.send), "recv": list(self.recv), "link_recv": list(self.link_recv),
            "fill_send": list(self.fill_send), "page_moves": len(self.pages), "state_moves": len(self.states),
            "fill_page_moves": len(self.fill_pages), "fill_state_moves": len(self.fill_states),
            "note": self.note}
        if moves:
            pm = lambda ms: [[m.page, m.src, m.dst] for m in ms]  # noqa: E731
            sm = lambda ms: [[m.store, m.h0, m.h1, m.src, m.dst] for m in ms]  # noqa: E731
            out["moves"] = {"pages": pm(self.pages), "states": sm(self.states),
                            "fill_pages": pm(self.fill_pages), "fill_states": sm(self.fill_states)}
        return out


# ---- the blocks: who holds and who needs what ------------------------------------------------------------
class _Blocks(NamedTuple):
    """One kind of block of the request: which prefill rank holds ([T_p, k]) and which decode rank
    needs ([T_d, k]) each, their PART's rank on either side, and bytes per block."""

    have: np.ndarray
    need: np.ndarray
    part_src: np.ndarray
    part_dst: np.ndarray
    nbytes: int
    store: str  # "" for pages


def _page_bytes(cfg: ModelConfig, page_size: int, fmt: str) -> int:
    return sum(store_row_bytes(cfg, s, fmt) * page_size * len(s.layers) for s in token_stores(cfg))


def _head_bytes(store: Store, dtype: str, state: str | None) -> int:
    heads = _heads(store)
    total = int(store_request_bytes(store, dtype, state)) * len(store.layers)
    if total % heads:
        raise ConfigError(f"store {store.name}: {total} bytes do not split evenly over {heads} heads")
    return total // heads


def _heads(store: Store) -> int:
    return store.head_count if store.heads and store.head_count else 1


def _share_mask(store: Store, group: Group) -> np.ndarray:
    """[T, H] bool: the heads of `store` each rank of `group` holds (`stores.state_share`)."""
    mask = np.zeros((group.ranks, _heads(store)), dtype=bool)
    for r in range(group.ranks):
        share = state_share(store, group.layout, r, group.ranks, group.owner)
        if share is not None:
            mask[r, list(share)] = True
    return mask


def _page_mask(group: Group, pages: np.ndarray) -> np.ndarray:
    """[T, n] bool: which rank of `group` holds each global page (`holdings.held_columns`)."""
    one = np.zeros(len(pages), dtype=np.int64)
    return held_columns(group.layout.ownership, np.array([group.owner]), one, pages, group.ranks)


def _resolve(cfg: ModelConfig, src: Group, dst: Group, context: int, page_size: int, kv_format: str,
             dtype: str, state: str | None) -> tuple[list[_Blocks], int, dict[str, int]]:
    if context < 0:
        raise ConfigError(f"context must be >= 0 tokens, got {context}")
    if page_size < 1:
        raise ConfigError(f"page size must be >= 1, got {page_size}")
    for g in (src, dst):
        cfg.check_ranks(g.ranks)
    fmt = format_name(act_dtype(dtype) if kv_format in ("auto", "", None) else kv_format)
    pb = _page_bytes(cfg, page_size, fmt)
    pages = np.arange(-(-context // page_size), dtype=np.int64)
    blocks = [_Blocks(_page_mask(src, pages), _page_mask(dst, pages), page_parts(pages, src.ranks),
                      page_parts(pages, dst.ranks), pb, "")]
    hb: dict[str, int] = {}
    for s in request_stores(cfg):
        hb[s.name] = _head_bytes(s, dtype, state)
        H = _heads(s)
        blocks.append(_Blocks(_share_mask(s, src), _share_mask(s, dst), head_parts(H, src.ranks),
                              head_parts(H, dst.ranks), hb[s.name], s.name))
    return blocks, pb, hb


def _pick(mask: np.ndarray, part: np.ndarray) -> np.ndarray:
    """Per block (column of `mask` [T, k]): its PART's rank if that rank is in the mask, else the first
    rank in it (-1 when none)."""
    k = np.arange(mask.shape[1])
    first = np.where(mask.any(axis=0), mask.argmax(axis=0), -1)
    return np.where(mask[part, k], part, first) if mask.shape[1] else first


def _route(b: _Blocks, fill: bool) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(link, fill) moves of one kind of block as (block, src, dst), ordered by block then dst."""
    sender = _pick(b.have, b.part_src)
    receiver = _pick(b.need, b.part_dst)
    if (b.need.any(axis=0) & (sender < 0)).any():
        raise ConfigError("the prefill group holds no copy of a block the decode group needs")  # a bug
    link: list[tuple[int, int, int]] = []
    inner: list[tuple[int, int, int]] = []
    blk, dst = np.nonzero(b.need.T)  # (block, needer) pairs in block order, then rank
    for k, d in zip(blk.tolist(), dst.tolist()):
        if not fill or d == receiver[k]:
            link.append((k, int(sender[k]), d))
        else:
            inner.append((k, int(receiver[k]), d))
    return link, inner


def _state_moves(store: str, moves: list[tuple[int, int, int]]) -> list[StateMove]:
    """Per-head moves -> head-range moves: the runs of heads one (src, dst) pair carries."""
    by_pair: dict[tuple[int, int], list[int]] = {}
    for h, s, d in moves:
        by_pair.setdefault((s, d), []).append(h)
    out = [StateMove(store, h0, h1, s, d) for (s, d), hs in by_pair.items() for h0, h1 in head_runs(hs)]
    return sorted(out, key=lambda m: (m.h0, m.dst, m.src))


def plan_pd(cfg: ModelConfig, src: Group, dst: Group, context: int, page_size: int, *,
            kv_format: str = "auto", dtype: str = "bf16", state: str | None = None,
            fill: bool = True) -> PDManifest:
    """The transfer of one request of `context` prompt tokens from the prefill group `src` to the decode
    group `dst`: every move and its bytes.

    `kv_format`: the per-token stores' element format (the store table's names; "auto": the activations'
    dtype of `dtype`, as the runtime resolves it); `dtype`: the model's weights (the conv state's dtype
    follows it); `state`: the recurrent state's dtype (default `stores.state_dtype`'s); `fill`: complete
    a replicated destination's copies inside the decode group (each block crosses the link once) rather
    than sending every copy over the link."""
    blocks, pb, hb = _resolve(cfg, src, dst, context, page_size, kv_format, dtype, state)
    send, recv = [0] * src.ranks, [0] * dst.ranks
    link_bytes = fill_bytes = 0
    pages: list[PageMove] = []
    fills: list[PageMove] = []
    states: list[StateMove] = []
    fill_states: list[StateMove] = []
    replicated: list[str] = []
    for b in blocks:
        link, inner = _route(b, fill)
        if (b.need.sum(axis=0) > 1).any():
            replicated.append(b.store or "pages")
        for _, s, d in link:
            send[s] += b.nbytes
            recv[d] += b.nbytes
        for _, _, d in inner:
            recv[d] += b.nbytes
        link_bytes += b.nbytes * len(link)
        fill_bytes += b.nbytes * len(inner)
        if b.store:
            states += _state_moves(b.store, link)
            fill_states += _state_moves(b.store, inner)
        else:
            pages = [PageMove(*m) for m in link]
            fills = [PageMove(*m) for m in inner]
    return PDManifest(src, dst, context, page_size, tuple(pages), tuple(states), tuple(fills),
                      tuple(fill_states), pb, hb, link_bytes, tuple(send), tuple(recv), fill_bytes,
                      _note(dst, replicated, fill))


def _note(dst: Group, replicated: list[str], fill: bool) -> str:
    """Why the link carries what it does: `replicated` names the kinds of block several decode ranks need."""
    if not replicated:
        return "every needed block crosses the link once, to the one decode rank that needs it"
    states = [k for k in replicated if k != "pages"]
    what = " and ".join((["every page"] if "pages" in replicated else [])
                        + ([f"the per-request state ({', '.join(states)})"] if states else []))
    if fill:
        return (f"{dst.layout.label} on the decode side replicates {what}: each block crosses the link once, "
                f"to its part's decode rank (page j to rank j % {dst.ranks}), and fill moves copy it to the "
                "other decode ranks inside the group")
    return (f"fill off: {dst.layout.label} on the decode side replicates {what}, and every decode rank that "
            "holds a replica receives its own copy over the link")


def local_page(layout: Layout, ranks: int, page: int) -> int:
    """Index of global page `page` in the local page list of the rank that holds it (`seq.pages[r]`
    lists a request's global pages in order): the page itself where a rank holds every page it holds
    whole (replicated, owner), page // T where ranks hold every T-th page (position: page j on j % T)."""
    if page < 0:
        raise ConfigError(f"page must be >= 0, got {page}")
    return page // ranks if Layout.parse(layout).ownership is Ownership.POSITION else page


def blind_bytes(cfg: ModelConfig, src: Group, dst: Group, context: int, page_size: int, *,
                kv_format: str = "auto", dtype: str = "bf16", state: str | None = None) -> int:
    """The layout-blind transfer (the issue's baseline): every prefill rank sends everything it holds of
    the request to every decode rank that needs any of it."""
    blocks, _, _ = _resolve(cfg, src, dst, context, page_size, kv_format, dtype, state)
    held = sum((b.have.sum(axis=1) * b.nbytes for b in blocks), np.zeros(src.ranks, dtype=np.int64))
    overlap: Callable[[_Blocks], np.ndarray] = lambda b: (  # noqa: E731  [T_p, T_d]: r holds some of d's
        b.have.astype(np.int64) @ b.need.T.astype(np.int64)) > 0
    wanted = np.zeros((src.ranks, dst.ranks), dtype=bool)
    for b in blocks:
        wanted |= overlap(b)
    return int((held * wanted.sum(axis=1)).sum())
