"""The KV transfer of prefill/decode disaggregation: Mooncake's transfer engine over one rank's pools.

Each side registers the memory of its pools once (every per-token store's tensor `[L, pages, P, row]`,
so one page of one layer is one contiguous run, MTP draft rows included as the latent's extra layers;
a KDA hybrid's state tensors `[slots, ...]`, one slot one run) and publishes `layout_info()`: where
those tensors are and their strides. The prefill side computes every destination address from the
decode side's info and moves a request's pages and slot in ONE `batch_transfer_sync_write` (contiguous
pages coalesced), bytes as stored: an FP8 cache moves as bytes, never re-encoded. Two sides that would
read each other's bytes differently (checkpoint, dtype, KV format, page size, store shapes) are refused
at the handshake (`check_peer`), naming the first difference.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger("splash.disagg")

# what both sides must agree on, in the order a difference is reported
IDENTITY = ("checkpoint", "model", "dtype", "kv_format", "page_size")
TRANSFER_SWITCH_S = 2e-4  # the interpreter's switch interval while a write is in flight (see `write`)


class TransferError(RuntimeError):
    """A write to the peer failed (the peer is gone, its memory unregistered, or a layout mismatch)."""


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both page lists go up by one together, the page
    pairs taken in the source's order (each pair is its own copy): two tables handed out backwards by
    LIFO free lists (pages freed 0..n come back n..0) are one run, not one piece per page."""
    out: list[tuple[int, int, int]] = []
    for s, d in sorted(zip(src, dst)):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def _describe(tensors: list[torch.Tensor], names: list[str]) -> list[dict[str, Any]]:
    """Per tensor: its base address and shape facts (axis 0 layers, axis 1 pages for a store)."""
    out = []
    for name, t in zip(names, tensors):
        if not t.is_contiguous():
            raise TransferError(f"store {name} is not contiguous; it cannot be registered for transfer")
        out.append({"name": name, "base": t.data_ptr(), "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."), "elem": t.element_size()})
    return out


class KVTransfer:
    """One rank's transfer engine: its pools registered, its layout published, writes to a peer.

    `pool`: the rank's KVPool; `state`: its StatePool (KDA hybrids) or None; `identity`: what a peer must
    match (`IDENTITY`'s keys: checkpoint hash, model name, dtype, KV format, page size)."""

    def __init__(self, pool: Any, state: Any, identity: dict[str, Any], host: str = "127.0.0.1") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # (the package, or Debian's libibverbs1 it loads)
            raise RuntimeError(f"prefill/decode disaggregation needs Mooncake's transfer engine: {e}. Run "
                               "`make setup` (pip install mooncake-transfer-engine-non-cuda; apt-get "
                               "install libibverbs1)") from None
        self.pool, self.state, self.identity, self.host = pool, state, dict(identity), host
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host} (code {rc})")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> bytes
        self.refresh()

    def _tensors(self) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor], list[str]]:
        pool = self.pool
        kv = pool.tensors()
        kv_names = ["latent", *pool.extra]
        st = self.state.tensors() if self.state is not None else []
        st_names = [f"{kind}{i}" for i in (self.state.layers if self.state is not None else ())
                    for kind in ("rec", "conv")]
        return kv, kv_names, st, st_names

    def refresh(self) -> None:
        """Register the pools' memory (again after a memory release/resume moved it); cheap when unchanged."""
        kv, _, st, _ = self._tensors()
        want = {t.data_ptr(): t.numel() * t.element_size() for t in (*kv, *st) if t.numel()}
        if want == self._registered:
            return
        kept = {a: n for a, n in self._registered.items() if want.get(a) == n}
        failed = [a for a in self._registered if a not in kept and self.engine.unregister_memory(a) != 0]
        self._registered = dict(kept)
        rc = self._register({a: n for a, n in want.items() if a not in kept})
        if rc != 0:
            # Mooncake still holds a region overlapping a new one (code -7: a freed pool's memory reused
            # before its unregister took): start over from nothing, once
            failed += [a for a in list(self._registered) if self.engine.unregister_memory(a) != 0]
            self._registered = {}
            rc = self._register(want)
        if rc != 0:
            raise TransferError(f"registering {sum(want.values())} bytes of KV memory with Mooncake failed "
                                f"(code {rc}; unregister failed at {[hex(a) for a in failed]})")

    def _register(self, regions: dict[int, int]) -> int:
        """Register `regions` (address -> bytes) in turn, recording each -> 0, or the first failure's code."""
        for addr, n in regions.items():
            rc = self.engine.register_memory(addr, n)
            if rc != 0:
                return rc
            self._registered[addr] = n
        return 0

    def layout_info(self) -> dict[str, Any]:
        """What the handshake exchanges (JSON-able): the session, the identity, every store's memory."""
        self.refresh()
        kv, kv_names, st, st_names = self._tensors()
        return {"session_id": self.session_id, **self.identity, "num_pages": self.pool.num_pages,
                "stores": _describe(kv, kv_names), "state": _describe(st, st_names),
                "num_slots": self.state.num_slots if self.state is not None else 0}

    def check_peer(self, info: dict[str, Any]) -> None:
        """Raise ValueError naming the first thing `info` (the peer's `layout_info`) disagrees on."""
        mine = self.layout_info()
        for k in IDENTITY:
            if info.get(k) != mine.get(k):
                raise ValueError(f"the prefill and decode engines disagree on {k}: this side has "
                                 f"{mine.get(k)!r}, the peer {info.get(k)!r}; run both with the same "
                                 f"checkpoint and the same --dtype, --kv-cache-dtype and --page-size")
        for part in ("stores", "state"):  # (a state's axis 0 is its slots, free to differ)
            a = [(s["name"], s["dtype"], s["shape"][0] if part == "stores" else None, s["shape"][2:])
                 for s in mine[part]]
            b = [(s["name"], s["dtype"], s["shape"][0] if part == "stores" else None, s["shape"][2:])
                 for s in info.get(part, [])]
            if a != b:
                raise ValueError(f"the prefill and decode engines disagree on the {part} layout: this side "
                                 f"has {a}, the peer {b}")

    def request_bytes(self, num_pages: int, slot: bool) -> int:
        """Bytes one request's `num_pages` pages (and its state slot) take over every store."""
        kv, _, st, _ = self._tensors()
        n = sum(t.shape[0] * (t.numel() // (t.shape[0] * t.shape[1])) * t.element_size() * num_pages
                for t in kv)
        return n + (sum(t[0].numel() * t.element_size() for t in st) if slot else 0)

    def write(self, peer: dict[str, Any], src_pages: Sequence[int], dst_pages: Sequence[int],
              src_slot: int = -1, dst_slot: int = -1,
              heads: Sequence[tuple[str, int, int, int]] | None = None) -> tuple[int, float, int]:
        """Write `src_pages` (this side's page ids) into the peer's `dst_pages`, and the state of
        `src_slot` into `dst_slot`, in one batch call. `heads`: which heads of the slot move, as
        (store, first local head here, first local head there, heads) with store "kda_state" (the
        recurrent tensors) or "kda_conv" (the conv windows) of every KDA layer; None: every head of both
        (the two sides hold the same heads). -> (bytes, seconds, pieces: the batch's (address, length)
        entries, one per run of pages per store and layer, and per slot's head range); TransferError on
        failure."""
        if len(src_pages) != len(dst_pages):
            raise TransferError(f"{len(src_pages)} pages to send but {len(dst_pages)} to receive them")
        far_pages, far_slots = int(peer["num_pages"]), int(peer.get("num_slots", 0))
        if any(len(far.get("shape", ())) < 2 or not far["shape"][1] for far in peer.get("stores", ())):
            raise TransferError("the decode side's KV memory is released (its pool has no pages): nothing "
                                "can be written into it until it resumes")
        bad = [p for p in dst_pages if not 0 <= p < far_pages]
        if bad or dst_slot >= max(far_slots, 0) > 0 or (dst_slot >= 0 and far_slots == 0):
            raise TransferError(f"destination pages {bad[:4]} / slot {dst_slot} are outside the peer's pool "
                                f"({far_pages} pages, {far_slots} slots)")
        self.refresh()
        kv, _, st, _ = self._tensors()
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        runs = _runs(src_pages, dst_pages)
        for t, far in zip(kv, peer["stores"]):
            L, pages = t.shape[0], t.shape[1]
            page = t.numel() // (L * pages) * t.element_size()
            far_pages = far["shape"][1]
            for layer in range(L):
                mine, theirs = t.data_ptr() + layer * pages * page, far["base"] + layer * far_pages * page
                for s, d, n in runs:
                    srcs.append(mine + s * page)
                    dsts.append(theirs + d * page)
                    lens.append(n * page)
        if (src_slot >= 0) != (dst_slot >= 0):
            raise TransferError(f"state slot {src_slot} -> {dst_slot}: a KDA model's request needs a slot "
                                "on both sides")
        if src_slot >= 0 and st:
            if heads is None:
                h = int(st[0].shape[1])
                heads = [("kda_state", 0, 0, h), ("kda_conv", 0, 0, h)]
            self._state_pieces(st, peer["state"], src_slot, dst_slot, heads, srcs, dsts, lens)
        if not srcs:
            return 0, 0.0, 0
        # The binding gives up the GIL for the write; taking it back waits for the server's other Python
        # threads (event loop, HTTP) to yield it, up to the switch interval (5 ms): ~20x the write itself
        # on loopback (docs/performance.md). A short interval while the write is in flight caps that wait.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, TRANSFER_SWITCH_S))
        t0 = time.perf_counter()
        try:
            rc = self.engine.batch_transfer_sync_write(peer["session_id"], srcs, dsts, lens)
        finally:
            dt = time.perf_counter() - t0
            sys.setswitchinterval(switch)
        if rc != 0:
            raise TransferError(f"the KV write to {peer['session_id']} failed (Mooncake code {rc}): the "
                                "decode side is gone or refused it")
        return sum(lens), dt, len(lens)

    @staticmethod
    def _state_pieces(st: list[torch.Tensor], far: list[dict[str, Any]], src_slot: int, dst_slot: int,
                      heads: Sequence[tuple[str, int, int, int]], srcs: list[int], dsts: list[int],
                      lens: list[int]) -> None:
        """The pieces of a slot's heads: per KDA layer, a head range of the recurrent state
        [slots, h, d, d] is one run; of the conv windows [slots, 3*h*d, K-1] (q, k, v parts) three. The
        two sides may hold different head counts (head-sharded at different T): offsets from each
        side's own shapes."""
        for k in range(0, len(st), 2):
            rec, conv, frec, fconv = st[k], st[k + 1], far[k], far[k + 1]
            d = int(rec.shape[2])
            h_mine, h_far = int(rec.shape[1]), int(frec["shape"][1])
            for store, a, b, n in heads:
                if not (0 <= a and a + n <= h_mine and 0 <= b and b + n <= h_far):
                    raise TransferError(f"heads {a}..{a + n} -> {b}..{b + n} of {store} are outside the "
                                        f"{h_mine} heads here / {h_far} on the peer")
                if store == "kda_state":
                    per = d * d * rec.element_size()
                    srcs.append(rec.data_ptr() + (src_slot * h_mine + a) * per)
                    dsts.append(frec["base"] + (dst_slot * h_far + b) * per)
                    lens.append(n * per)
                elif store == "kda_conv":
                    per = d * int(conv.shape[2]) * conv.element_size()
                    for part in range(3):
                        srcs.append(conv.data_ptr() + (src_slot * 3 * h_mine + part * h_mine + a) * per)
                        dsts.append(fconv["base"] + (dst_slot * 3 * h_far + part * h_far + b) * per)
                        lens.append(n * per)
                else:
                    raise TransferError(f"unknown per-request store {store!r}")

    def close(self) -> None:
        """Unregister the memory (the engine object itself is freed with this one)."""
        for addr in self._registered:
            try:
                self.engine.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - closing
                log.debug("unregister of %#x failed", addr)
        self._registered = {}
