"""Data-plane collectives through one shared-memory segment, for CPU ranks on one host.

Why: gloo pays 0.3-2 ms per collective on loopback however small the tensor (measured on the 2-core
dev VM: all_reduce of 256 B 1.6-2.2 ms, broadcast 0.5 ms, against a 33 us TCP round trip), and a
decode step makes 9 (TP) to 17 (DOP) of them, so on CPU most of a step was gloo. Here a collective is
one copy into this rank's slot, one flag store, one wait for the other ranks' flags and one read: tens
of microseconds. CPU inference stacks do the same (vLLM's and SGLang's CPU shm all-reduce, DeepSpeed).

Protocol. Call k (every rank makes the same calls in the same order, as SPMD code does) uses buffer
set k % 2. A rank writes its header (payload bytes, rows, per-rank row counts) and payload into its
slot of that set, publishes k in its flag, waits until every flag reaches k, and reads what it needs.
One synchronisation per call suffices: a rank publishes k + 1 only after it has finished reading call
k, and a rank writes set k % 2 again only at call k + 2, after it has seen every flag at k + 1.
Ordering relies on x86-64's total store order (payload stores become visible before the flag store),
so the segment is only used on x86-64 Linux. A message larger than a slot goes to gloo instead: every
rank sees every header, so all ranks take the same path.

Only the step's data plane lives here. Control messages (step plans: ranks may sit idle between
requests, and a spinning wait would burn a core) and the layout-switch group (whose collectives must be
asynchronous, to overlap with compute) stay on gloo; the async forms here complete before returning.
Waiting spins, then yields, then sleeps; it checks every half second that the other ranks' processes
are alive (a dead peer raises at once) and gives up after the group's collective timeout.
"""

from __future__ import annotations

import mmap
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from splash.dist.comm import Communicator, Handle, _done, _row_bytes
from splash.dist.stats import Tag

SLOT_BYTES = 4 << 20  # payload bytes per rank and buffer set; larger messages go to gloo
ENV = "SPLASH_COMM"  # "gloo" turns the shared-memory data plane off (e.g. to compare)
_LINE = 64  # one cache line per rank flag, so flags never share a line
_SPIN, _YIELD = 64, 4096  # busy polls, then sched_yield polls, then 20 us sleeps


def supported() -> bool:
    """x86-64 Linux (the ordering argument above) and not turned off with SPLASH_COMM=gloo."""
    return (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
            and os.environ.get(ENV, "shm").lower() != "gloo")


def _alive(pid: int) -> bool:
    """False once `pid` has exited, zombies included (an unreaped child still answers kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class _Segment:
    """The mapped file: flags and pids (one line per rank), then 2 buffer sets of `world` slots."""

    def __init__(self, fd: int, world: int, slot: int) -> None:
        self.world, self.slot = world, slot
        self.hdr = _LINE * -(-8 * (2 + world) // _LINE)  # [payload bytes, rows, counts[world]]
        self.ctrl = _LINE * (2 * world + 2)
        self.mm = mmap.mmap(fd, self.nbytes(world, slot))
        self.words = np.frombuffer(self.mm, dtype=np.int64, count=self.ctrl // 8)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        step = _LINE // 8
        self.flags = self.words[0:world * step:step]
        self.pids = self.words[world * step:2 * world * step:step]
        self.token = self.words[2 * world * step:2 * world * step + 2]

        # Views made once: building a numpy or dtype view costs microseconds, a collective makes several.
        offs = [[self.ctrl + (par * world + r) * (self.hdr + slot) for r in range(world)] for par in (0, 1)]
        self.headers = [[np.frombuffer(self.mm, dtype=np.int64, count=2 + world, offset=o) for o in row]
                        for row in offs]
        self.slots = [[self.bytes[o + self.hdr:o + self.hdr + slot] for o in row] for row in offs]
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    @staticmethod
    def nbytes(world: int, slot: int) -> int:
        return _LINE * (2 * world + 2) + 2 * world * (_LINE * -(-8 * (2 + world) // _LINE) + slot)

    def typed(self, par: int, r: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank r's whole slot of buffer set `par` as a flat tensor of `dtype`."""
        key = (par, r, dtype)
        v = self._typed.get(key)
        if v is None:
            v = self._typed[key] = self.slots[par][r].view(dtype)
        return v

    def close(self) -> None:
        self.words = self.flags = self.pids = self.token = None  # type: ignore[assignment]
        self.bytes = self.headers = self.slots = None  # type: ignore[assignment]
        self._typed.clear()
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


class ShmCommunicator(Communicator):
    """`Communicator` whose tensor collectives go through a shared-memory segment (see module doc)."""

    def __init__(self, seg: _Segment, group: Any, rank: int, world: int, control_group: Any,
                 timeout_s: float, stats: Any = None) -> None:
        super().__init__(group, rank, world, "cpu", control_group=control_group, stats=stats)
        self.seg, self.timeout_s, self._k = seg, float(timeout_s), 0
        self.fallbacks = 0  # collectives that went to gloo because a message exceeded a slot

    # ---- the protocol ---------------------------------------------------------------------------
    def _publish(self, t: torch.Tensor, rows: int, counts: Sequence[int] | None) -> tuple[int, bool]:
        """Write header + payload (if it fits) for the next call, raise the flag, wait for everyone.
        Returns (buffer set, whether every rank's payload fit)."""
        self._k += 1
        k, par, seg = self._k, self._k & 1, self.seg
        n = t.numel()
        nbytes = n * t.element_size()
        hdr = seg.headers[par][self.rank]
        hdr[0], hdr[1] = nbytes, rows
        if counts is not None:
            hdr[2:] = counts
        if nbytes <= seg.slot and n:
            seg.typed(par, self.rank, t.dtype)[:n].view(t.shape).copy_(t)
        seg.flags[self.rank] = k
        self._wait(k)
        fits = max(int(h[0]) for h in seg.headers[par]) <= seg.slot
        if not fits:
            self.fallbacks += 1
        return par, fits

    def _wait(self, k: int) -> None:
        flags = self.seg.flags
        if (flags >= k).all():
            return
        t0 = time.monotonic()
        check = t0 + 0.5
        n = 0
        while not (flags >= k).all():
            n += 1
            if n > _YIELD:
                time.sleep(2e-5)
            elif n > _SPIN:
                os.sched_yield()
            if n % 256 == 0:
                now = time.monotonic()
                if now >= check:
                    check = now + 0.5
                    self._check_peers(k)
                if now - t0 > self.timeout_s:
                    late = [r for r in range(self.world) if flags[r] < k]
                    raise RuntimeError(f"rank {self.rank}: ranks {late} did not reach collective #{k} in "
                                       f"{self.timeout_s:g} s (a rank hung or left the step)")

    def _check_peers(self, k: int) -> None:
        for r in range(self.world):
            if r != self.rank and self.seg.flags[r] < k and not _alive(int(self.seg.pids[r])):
                raise RuntimeError(f"rank {self.rank}: rank {r} (pid {int(self.seg.pids[r])}) exited while "
                                   f"this rank waited in collective #{k}")

    def _rows(self, par: int, r: int, like: torch.Tensor, rows: int, first: int = 0) -> torch.Tensor:
        """Rows [first, first + rows) of rank r's payload, shaped like `like`'s rows (a view)."""
        per = int(np.prod(like.shape[1:], dtype=np.int64))
        flat = self.seg.typed(par, r, like.dtype)[first * per:(first + rows) * per]
        return flat.view(rows, *like.shape[1:])

    # ---- tensors --------------------------------------------------------------------------------
    def all_reduce_async(self, t: torch.Tensor, tag: Tag = None) -> Handle:
        nbytes = t.numel() * t.element_size()
        par, fits = self._publish(t, 0, None)
        if not fits:
            return super().all_reduce_async(t, tag)
        self.stats.record("all_reduce", tag, 2 * (self.world - 1) * nbytes // self.world)
        n = t.numel()
        if n:
            views = [self.seg.typed(par, r, t.dtype)[:n].view(t.shape) for r in range(self.world)]
            t.copy_(views[0])  # the same order on every rank: bit-identical sums everywhere
            for v in views[1:]:
                t.add_(v)
        return _done(t)

    def all_gather_var_async(self, t: torch.Tensor, tag: Tag = None,
                             sizes: Sequence[int] | None = None) -> Handle:
        n = int(t.shape[0])
        if sizes is not None:
            sizes = self._check_counts(sizes, "sizes")
            if sizes[self.rank] != n:
                raise ValueError(f"rank {self.rank}: sizes say {sizes[self.rank]} rows, tensor has {n}")
        par, fits = self._publish(t, n, None)
        got = [int(h[1]) for h in self.seg.headers[par]]
        if sizes is not None and got != sizes:
            raise ValueError(f"sizes {sizes} disagree with the rows the ranks sent, {got}")
        if not fits:
            return super().all_gather_var_async(t, tag, got)
        self.stats.record("all_gather", tag, n * _row_bytes(t) * (self.world - 1))
        parts = [self._rows(par, r, t, got[r]) for r in range(self.world)]
        return _done(torch.cat(parts) if parts else t)

    def all_to_all_var_async(self, t: torch.Tensor, send_counts: Sequence[int], tag: Tag = None,
                             recv_counts: Sequence[int] | None = None) -> Handle:
        send = self._check_counts(send_counts, "send_counts")
        if sum(send) != t.shape[0]:
            raise ValueError(f"send_counts {send} sum to {sum(send)}, tensor has {t.shape[0]} rows")
        par, fits = self._publish(t, int(t.shape[0]), send)
        every = [h[2:].tolist() for h in self.seg.headers[par]]
        recv = [every[j][self.rank] for j in range(self.world)]
        if recv_counts is not None and self._check_counts(recv_counts, "recv_counts") != recv:
            raise ValueError(f"rank {self.rank}: recv_counts {list(recv_counts)} disagree with what the "
                             f"ranks send, {recv}")
        if not fits:
            return super().all_to_all_var_async(t, send, tag, recv)
        self.stats.record("all_to_all", tag, (sum(send) - send[self.rank]) * _row_bytes(t))
        parts = [self._rows(par, j, t, recv[j], sum(every[j][:self.rank])) for j in range(self.world)]
        return _done(torch.cat(parts))

    def close(self) -> None:
        self.seg.close()


def attach(group: Any, rank: int, world: int, control_group: Any, timeout_s: float,
           slot_bytes: int = SLOT_BYTES) -> ShmCommunicator | None:
    """Every rank calls this once, at start-up: rank 0 creates the segment file (in /dev/shm), the
    others map it and check a random token, all agree, and rank 0 unlinks the file (the mappings stay,
    so nothing is left behind even if a rank dies later). None on every rank if any rank cannot map
    it - e.g. ranks on different hosts - and the caller keeps gloo."""
    import torch.distributed as dist

    seg: _Segment | None = None
    ok, path, msg = False, None, None
    if rank == 0:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(base, f"splash-comm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, _Segment.nbytes(world, slot_bytes))
                seg = _Segment(fd, world, slot_bytes)
            finally:
                os.close(fd)
            token = np.frombuffer(os.urandom(16), dtype=np.int64)
            seg.token[:] = token
            msg: Any = (path, token.tolist())
        except OSError:
            msg = None
    out = [msg]
    dist.broadcast_object_list(out, src=0, group=control_group)
    msg = out[0]
    if msg is not None and rank != 0:
        try:
            fd = os.open(msg[0], os.O_RDWR)
            try:
                seg = _Segment(fd, world, slot_bytes)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            seg = None
    if seg is not None and msg is not None:
        ok = seg.token.tolist() == msg[1]
        if ok:
            seg.pids[rank] = os.getpid()
    oks: list[Any] = [None] * world
    dist.all_gather_object(oks, ok, group=control_group)
    if rank == 0 and path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not all(oks):
        if seg is not None:
            seg.close()
        return None
    return ShmCommunicator(seg, group, rank, world, control_group, timeout_s)
