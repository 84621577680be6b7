"""The prefill-to-decode transfer priced (issue 47): what a prefill group's layout costs in time to first
token once its requests' KV must cross the link to the decode group.

The bytes are the transfer manifests' (`splash.core.pd.plan_pd`: every needed block crosses the link
once, a replicated source spreads its sending over its ranks, a partitioned one sends from the rank that
holds it), so the price follows the prefill layout: a TP or CP prefill sends from every rank, a DP or DOP
prefill from each request's owner. A link has two ends, each rank its own NIC: a batch's transfer takes
its busiest rank-link on either side, the bytes over `theta.pd_bw` plus `theta.pd_link_lat` per
transfer that link carries (transfers on one link run one after another). Fill moves inside the decode
group ride the group's own fabric and are not priced here.

`ttft_price` (step time + transfer) is what a prefill group's policy minimises (`policy.evaluate(...,
pd=...)`); `fit_link` turns measured transfers into the two theta terms.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splash.core.costmodel import Batch, step_cost
from splash.core.layouts import Layout, round_robin_owners
from splash.core.model_config import ConfigError
from splash.core.pd import Group, plan_pd
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

LINK_CACHE = 4096  # (source, destination, pages) manifests' per-rank bytes kept per model


@dataclass(frozen=True)
class PDDest:
    """The decode group a prefill group's requests go to: its layout on `ranks` ranks; `fill`: complete a
    replicated destination inside the decode group (each block crosses the link once)."""

    layout: Layout
    ranks: int
    fill: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        if self.ranks < 1:
            raise ConfigError(f"the decode group needs at least one rank, got {self.ranks}")


@dataclass(frozen=True)
class TransferLoads:
    """A batch's transfer, rate-free: bytes and transfers on each rank-link of either group."""

    send: np.ndarray  # [T_p] bytes each prefill rank sends over the link
    recv: np.ndarray  # [T_d] bytes each decode rank receives over the link (fill excluded)
    sends: np.ndarray  # [T_p] transfers each prefill rank takes part in
    recvs: np.ndarray  # [T_d] transfers each decode rank takes part in
    link_bytes: int  # bytes that cross between the groups

    def seconds(self, theta: Theta) -> float:
        """The busiest rank-link of either side: bytes / pd_bw + pd_link_lat per transfer it carries."""
        if not self.link_bytes:
            return 0.0
        bw, lat = theta.pd_bw, theta.pd_link_lat
        return float(max((self.send / bw + self.sends * lat).max(initial=0.0),
                         (self.recv / bw + self.recvs * lat).max(initial=0.0)))


def request_link(sizes: AttentionSizes, src: Group, dst: Group, context: int, page_size: int,
                 fill: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(bytes each prefill rank sends, bytes each decode rank receives over the link) for one request:
    the manifest's own counts, cached per page count (whole pages move, so bytes follow pages; the
    `LINK_CACHE` most recent per model)."""
    pages = -(-int(context) // page_size)

    def plan() -> tuple[tuple[int, ...], tuple[int, ...]]:
        m = plan_pd(sizes.cfg, src, dst, pages * page_size, page_size, kv_format=sizes.kv_dtype,
                    dtype=sizes.dtype, state=sizes.state_dtype, fill=fill)
        return m.send, m.link_recv

    lru: OrderedDict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = sizes.memo("pd_link", OrderedDict)
    key = (src, dst, pages, page_size, fill)
    if key in lru:
        lru.move_to_end(key)
    else:
        lru[key] = plan()
        if len(lru) > LINK_CACHE:  # a server sees many prompt lengths: keep the recent ones
            lru.popitem(last=False)
    send, recv = lru[key]
    return np.asarray(send, dtype=np.float64), np.asarray(recv, dtype=np.float64)


def transfer_loads(sizes: AttentionSizes, layout: Layout, ranks: int, batch: Batch, dest: PDDest,
                   page_size: int, finishing: Sequence[bool] | np.ndarray | None = None,
                   dest_owners: Sequence[int] | None = None) -> TransferLoads:
    """The transfer of the batch's requests whose prompts finish (`finishing`; None: every request, a
    batch prefilled in one step), each at its context, from `layout` on `ranks` (owners: the batch's) to
    `dest` (owners `dest_owners`; None: round robin over the finishing requests, as a decode balances)."""
    n = batch.size
    fin = np.ones(n, dtype=bool) if finishing is None else np.asarray(finishing, dtype=bool).reshape(-1)
    if fin.shape != (n,):
        raise ConfigError(f"finishing: one flag per request of the batch ({n}), got {fin.shape[0]}")
    idx = np.flatnonzero(fin)
    d_own = (round_robin_owners(len(idx), dest.ranks) if dest_owners is None
             else [int(x) for x in np.asarray(dest_owners).reshape(-1)])
    if len(d_own) != len(idx):
        raise ConfigError(f"dest_owners: one decode owner per finishing request ({len(idx)}), "
                          f"got {len(d_own)}")
    send, recv = np.zeros(ranks), np.zeros(dest.ranks)
    sends, recvs = np.zeros(ranks), np.zeros(dest.ranks)
    for i, od in zip(idx.tolist(), d_own):
        src = Group(layout, ranks, int(batch.owners[i]) if layout.owned else 0)
        dst = Group(dest.layout, dest.ranks, od if dest.layout.owned else 0)
        s, r = request_link(sizes, src, dst, int(batch.contexts[i]), page_size, dest.fill)
        send += s
        recv += r
        sends += s > 0
        recvs += r > 0
    return TransferLoads(send, recv, sends, recvs, int(send.sum()))


def transfer_seconds(sizes: AttentionSizes, theta: Theta, layout: Layout, batch: Batch, dest: PDDest,
                     page_size: int, finishing: Sequence[bool] | np.ndarray | None = None,
                     dest_owners: Sequence[int] | None = None) -> float:
    """Seconds the link takes for the finishing requests' transfer (see `transfer_loads`)."""
    return transfer_loads(sizes, layout, theta.ranks, batch, dest, page_size, finishing,
                          dest_owners).seconds(theta)


def ttft_price(sizes: AttentionSizes, theta: Theta, layout: Layout | str, batch: Batch, dest: PDDest,
               page_size: int, finishing: Sequence[bool] | np.ndarray | None = None,
               dest_owners: Sequence[int] | None = None) -> float:
    """A prefill layout's price for time to first token: the prefill step of `batch` in `layout` (Eq 10)
    plus the transfer of its finishing requests to the decode group. What a prefill group's runtime calls
    to compare its layouts (the policy does, with `evaluate(..., pd=dest)`)."""
    lay = Layout.parse(layout)
    return (step_cost(lay, sizes, batch, theta, page_size).total
            + transfer_seconds(sizes, theta, lay, batch, dest, page_size, finishing, dest_owners))


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(pd_link_bw, pd_link_lat) from measured transfers of one rank-link: the least-squares line
    seconds = lat + bytes / bw (the latency clipped at 0). Needs two distinct sizes."""
    x, y = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if x.shape != y.shape or len(x) < 2 or np.ptp(x) == 0:
        raise ConfigError("fitting the link needs at least two transfers of different sizes")
    slope, lat = np.polyfit(x, y, 1)
    if not slope > 0:
        raise ConfigError("measured transfers do not take longer with more bytes; measure larger ones")
    return float(1.0 / slope), float(max(lat, 0.0))
