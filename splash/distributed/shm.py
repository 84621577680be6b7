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

Rank 0's step plans travel through a mailbox in the same segment (`broadcast_object` from rank 0):
rank 0 waits until every rank has taken the last message (at once in practice: a step's collectives
come between), writes the pickled bytes and publishes the message number; a rank waiting for the next
message spins, yields (20 ms), then sleeps in naps of at most 0.5 ms (1 ms once idle for a second, 5 ms
after ten: ranks sit idle between requests, and a spinning wait would burn a core; an idle rank takes
~1.7% of a core, against ~0.5% blocked in gloo), checks twice a second that rank 0's
process is alive, and never times out. A message larger than the mailbox goes to gloo, announced in the
mailbox, so every rank takes the same path. On gloo a plan cost a broadcast of 0.3-0.8 ms per step.
The layout-switch group (whose collectives must be asynchronous, to overlap with compute) and the other
control messages stay on gloo; the async forms here complete before returning.
Waiting spins, then yields, then sleeps; it checks every half second that the other ranks' processes
are alive (a dead peer raises at once) and gives up after the group's collective timeout.
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import platform
import sys
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from splash.distributed.comm import Communicator, Handle, _done, _row_bytes
from splash.distributed.stats import Tag

SLOT_BYTES = 4 << 20  # payload bytes per rank and buffer set; larger messages go to gloo
MAIL_BYTES = 1 << 20  # rank 0's step-plan mailbox; a larger plan goes to gloo
ENV = "SPLASH_COMM"  # (its name: --cpu-comm gloo / SPLASH_COMM=gloo turns this data plane off)
_LINE = 64  # one cache line per rank flag, so flags never share a line
_SPIN_S, _YIELD_S = 5e-5, 1e-3  # busy-poll this long, then yield the core until this long, then sleep
_MAIL_YIELD_S = 2e-2  # a rank waiting for rank 0's next plan yields this long before napping: rank 0's
#                      host work between steps (sampling, scheduling) takes 1-2 ms, and a nap then
#                      started the next step up to 0.5 ms late on every rank


def supported() -> bool:
    """x86-64 Linux (the ordering argument above). Whether to use it at all is the engine's `cpu_comm`
    (`--cpu-comm`, SPLASH_COMM), which the rank grid passes to `attach` as `enabled`."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _alive(pid: int) -> bool:
    """False once `pid` has exited, zombies included (an unreaped child still answers kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


_HDR = 5  # header words before the per-rank counts
_OPS = {"all_reduce": 1, "all_gather": 2, "all_to_all": 3}


def _hdr_bytes(world: int) -> int:
    return _LINE * -(-8 * (_HDR + world) // _LINE)


@functools.cache
def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return -1


class _Segment:
    """The mapped file: flags and pids (one line per rank), then 2 buffer sets of `world` slots, then
    the mailbox: its line (message number, bytes), one line per rank (the last message it took), and
    `mail` bytes of payload."""

    def __init__(self, fd: int, world: int, slot: int, mail: int = MAIL_BYTES) -> None:
        self.world, self.slot, self.mail = world, slot, mail
        self.hdr = _hdr_bytes(world)  # [payload bytes, rows, op, dtype, shape key, counts[world]]
        self.ctrl = _LINE * (2 * world + 2)
        self.mm = mmap.mmap(fd, self.nbytes(world, slot, mail))
        self.words = np.frombuffer(self.mm, dtype=np.int64, count=self.ctrl // 8)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        step = _LINE // 8
        self.flags = self.words[0:world * step:step]
        self.pids = self.words[world * step:2 * world * step:step]
        self.token = self.words[2 * world * step:2 * world * step + 2]

        # Views made once: building a numpy or dtype view costs microseconds, a collective makes several.
        offs = [[self.ctrl + (par * world + r) * (self.hdr + slot) for r in range(world)] for par in (0, 1)]
        self.headers = [[np.frombuffer(self.mm, dtype=np.int64, count=_HDR + world, offset=o) for o in row]
                        for row in offs]
        self.slots = [[self.bytes[o + self.hdr:o + self.hdr + slot] for o in row] for row in offs]
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        box = self.ctrl + 2 * world * (self.hdr + slot)
        self.box = np.frombuffer(self.mm, dtype=np.int64, count=2, offset=box)  # [message number, bytes]
        self.taken = np.frombuffer(self.mm, dtype=np.int64, count=world * step, offset=box + _LINE)[::step]
        self.letter = memoryview(self.mm)[box + _LINE * (world + 1):box + _LINE * (world + 1) + mail]

    @staticmethod
    def nbytes(world: int, slot: int, mail: int = MAIL_BYTES) -> int:
        return _LINE * (2 * world + 2) + 2 * world * (_hdr_bytes(world) + slot) + _LINE * (world + 1) + mail

    def typed(self, par: int, r: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank r's whole slot of buffer set `par` as a flat tensor of `dtype`."""
        key = (par, r, dtype)
        v = self._typed.get(key)
        if v is None:
            v = self._typed[key] = self.slots[par][r].view(dtype)
        return v

    def close(self) -> None:
        """Drop this object's views. The mapping itself is never closed by hand: torch views keep the
        mmap alive, and unmapping under a live view would crash a reader; it goes with the last view."""
        self.words = self.flags = self.pids = self.token = None  # type: ignore[assignment]
        self.bytes = self.headers = self.slots = None  # type: ignore[assignment]
        self.box = self.taken = None  # type: ignore[assignment]
        if self.letter is not None:
            self.letter.release()
            self.letter = None  # type: ignore[assignment]
        self._typed.clear()


class ShmCommunicator(Communicator):
    """`Communicator` whose tensor collectives go through a shared-memory segment (see module doc)."""

    def __init__(self, seg: _Segment, group: Any, rank: int, world: int, control_group: Any,
                 timeout_s: float, stats: Any = None) -> None:
        super().__init__(group, rank, world, "cpu", control_group=control_group, stats=stats)
        self.seg, self.timeout_s, self._k = seg, float(timeout_s), 0
        self.fallbacks = 0  # collectives that went to gloo because a message exceeded a slot
        self.check_pids = True  # off when a peer lives in another PID namespace (its pid means nothing here)
        self._broken: str | None = None  # after a timeout, dead peer or mismatch: call numbers no longer pair
        self._m = 0  # mailbox messages so far (rank 0's broadcast_object)

    # ---- the protocol ---------------------------------------------------------------------------
    def _publish(self, op: str, t: torch.Tensor, rows: int, counts: Sequence[int] | None) -> tuple[int, bool]:
        """Write header + payload (if it fits) for the next call, raise the flag, wait for everyone,
        check that every rank made the same call. Returns (buffer set, whether every payload fit)."""
        if self._broken is not None:
            raise RuntimeError(f"rank {self.rank}: the shared-memory group is unusable after: {self._broken}")
        self._k += 1
        k, par, seg = self._k, self._k & 1, self.seg
        n = t.numel()
        nbytes = n * t.element_size()
        hdr = seg.headers[par][self.rank]
        # what every rank must agree on: the op, the dtype, and the shape (all_reduce) or row size
        key = n if op == "all_reduce" else _row_bytes(t)
        hdr[0], hdr[1], hdr[2], hdr[3], hdr[4] = nbytes, rows, _OPS[op], _dtype_code(t.dtype), key
        if counts is not None:
            hdr[_HDR:] = counts
        if nbytes <= seg.slot and n:
            seg.typed(par, self.rank, t.dtype)[:n].view(t.shape).copy_(t)
        seg.flags[self.rank] = k
        self._wait(k)
        heads = seg.headers[par]
        if any(int(h[2]) != _OPS[op] or int(h[3]) != hdr[3] or int(h[4]) != key for h in heads):
            seen = [(int(h[2]), int(h[4])) for h in heads]
            self._broken = (f"collective #{k}: ranks made different calls (op code, size per rank: {seen}; "
                            f"this rank: {op} of {tuple(t.shape)} {t.dtype})")
            raise RuntimeError(f"rank {self.rank}: {self._broken}")
        fits = max(int(h[0]) for h in heads) <= seg.slot
        if not fits:
            self.fallbacks += 1
        return par, fits

    def _wait(self, k: int, flags: Any = None, what: str = "collective") -> None:
        """Until every rank's counter (`flags`: the collective flags, or the mailbox's `taken`) reaches
        k: poll the first lagging rank (one scalar read), spinning for ~50 us, then yielding the core
        until ~1 ms, then sleeping 50 us doubling to 0.5 ms - so a rank waiting out a long prefill on
        another rank costs little CPU on a 2-core machine."""
        flags = self.seg.flags if flags is None else flags
        t0 = check = 0.0
        nap = 5e-5
        for r in range(self.world):
            while flags[r] < k:
                now = time.monotonic()
                if not t0:
                    t0, check = now, now + 0.5
                waited = now - t0
                if waited < _SPIN_S:
                    continue
                if waited < _YIELD_S:
                    os.sched_yield()
                    continue
                time.sleep(nap)
                nap = min(2 * nap, 5e-4)
                if now >= check:
                    check = now + 0.5
                    self._check_peers(k, flags, what)
                if waited > self.timeout_s:
                    late = [j for j in range(self.world) if flags[j] < k]
                    self._broken = f"ranks {late} did not reach {what} #{k} in {self.timeout_s:g} s"
                    raise RuntimeError(f"rank {self.rank}: {self._broken} (a rank hung or left the step)")

    def _check_peers(self, k: int, flags: Any = None, what: str = "collective") -> None:
        if not self.check_pids:
            return
        flags = self.seg.flags if flags is None else flags
        for r in range(self.world):
            if r != self.rank and flags[r] < k and not _alive(int(self.seg.pids[r])):
                self._broken = f"rank {r} (pid {int(self.seg.pids[r])}) exited during {what} #{k}"
                raise RuntimeError(f"rank {self.rank}: {self._broken}")

    def _rows(self, par: int, r: int, like: torch.Tensor, rows: int, first: int = 0) -> torch.Tensor:
        """Rows [first, first + rows) of rank r's payload, shaped like `like`'s rows (a view)."""
        per = int(np.prod(like.shape[1:], dtype=np.int64))
        flat = self.seg.typed(par, r, like.dtype)[first * per:(first + rows) * per]
        return flat.view(rows, *like.shape[1:])

    # ---- rank 0's messages ------------------------------------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """From rank 0 through the mailbox (see the module doc); from another rank, or where a peer's
        pid cannot be watched (an idle wait could never notice rank 0 gone), through gloo."""
        if src != 0 or not self.check_pids:
            return super().broadcast_object(obj, src)
        if self._broken is not None:
            raise RuntimeError(f"rank {self.rank}: the shared-memory group is unusable after: {self._broken}")
        self._m += 1
        m, seg = self._m, self.seg
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(payload)
            fits = n <= seg.mail
            self._wait(m - 1, seg.taken, "message")  # every rank took the last one (rank 0: below)
            if fits:
                seg.letter[:n] = payload
            seg.box[1] = n if fits else -1
            seg.box[0] = m  # after the bytes (total store order): a reader that sees m sees them
            seg.taken[0] = m
            if not fits:
                return super().broadcast_object(obj, src)
            self.stats.record("broadcast_object", None, n * (self.world - 1))
            return obj
        self._wait_mail(m)
        n = int(seg.box[1])
        if n < 0:
            seg.taken[self.rank] = m
            return super().broadcast_object(None, src)
        data = bytes(seg.letter[:n])
        seg.taken[self.rank] = m
        return pickle.loads(data)

    def _wait_mail(self, m: int) -> None:
        """A rank other than 0: until message m is published. No deadline (ranks sit idle between
        requests), but rank 0's process is watched; naps stay short so the first step after a pause
        starts within a millisecond (5 ms after ten seconds idle: 1 ms naps took ~3% of a core)."""
        box, t0 = self.seg.box, time.monotonic()
        check, nap = t0 + 0.5, 5e-5
        while box[0] < m:
            now = time.monotonic()
            waited = now - t0
            if waited < _SPIN_S:
                continue
            if waited < _MAIL_YIELD_S:
                os.sched_yield()
                continue
            time.sleep(nap)
            nap = min(2 * nap, 5e-4 if waited < 1.0 else 1e-3 if waited < 10.0 else 5e-3)
            if now >= check:
                check = now + 0.5
                if not _alive(int(self.seg.pids[0])):
                    self._broken = f"rank 0 (pid {int(self.seg.pids[0])}) exited"
                    raise RuntimeError(f"rank {self.rank}: {self._broken} while this rank waited for a step")

    # ---- tensors --------------------------------------------------------------------------------
    def all_reduce_async(self, t: torch.Tensor, tag: Tag = None) -> Handle:
        n = t.numel()
        par, fits = self._publish("all_reduce", t, 0, None)
        if not fits:
            return super().all_reduce_async(t, tag)
        self.stats.record("all_reduce", tag, 2 * (self.world - 1) * n * t.element_size() // self.world)
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
        par, fits = self._publish("all_gather", t, n, None)
        got = [int(h[1]) for h in self.seg.headers[par]]
        if sizes is not None and got != sizes:
            raise ValueError(f"sizes {sizes} disagree with the rows the ranks sent, {got}")
        if not fits:
            return super().all_gather_var_async(t, tag, got)
        self.stats.record("all_gather", tag, n * _row_bytes(t) * (self.world - 1))
        parts = [self._rows(par, r, t, got[r]) for r in range(self.world)]
        return _done(torch.cat(parts))

    def all_to_all_var_async(self, t: torch.Tensor, send_counts: Sequence[int], tag: Tag = None,
                             recv_counts: Sequence[int] | None = None) -> Handle:
        send = self._check_counts(send_counts, "send_counts")
        if sum(send) != t.shape[0]:
            raise ValueError(f"send_counts {send} sum to {sum(send)}, tensor has {t.shape[0]} rows")
        par, fits = self._publish("all_to_all", t, int(t.shape[0]), send)
        every = [h[_HDR:].tolist() for h in self.seg.headers[par]]
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
        self._broken = "the communicator was closed"
        self.seg.close()


def attach(group: Any, rank: int, world: int, control_group: Any, timeout_s: float,
           slot_bytes: int = SLOT_BYTES, enabled: bool | None = None,
           mail_bytes: int = MAIL_BYTES) -> ShmCommunicator | None:
    """Every gloo rank calls this once, at start-up, whether or not it can use shared memory (so the
    two control-plane collectives here always pair up): rank 0 creates the segment file in /dev/shm
    and reserves its pages (a full /dev/shm fails here, not with SIGBUS mid-run), the others map it and
    check a random token and the host's boot id, all agree, and rank 0 unlinks the file (the mappings
    stay, so nothing is left behind even if a rank dies later). None on every rank if any rank cannot
    or will not use it (other host, `--cpu-comm gloo`, not x86-64 Linux): the caller keeps gloo.
    `enabled`: this rank is willing (None: where `supported`)."""
    import torch.distributed as dist

    if slot_bytes <= 0 or slot_bytes % _LINE or mail_bytes < 0 or mail_bytes % _LINE:
        raise ValueError(f"slot_bytes and mail_bytes must be multiples of {_LINE} (slots > 0), got "
                         f"{slot_bytes} and {mail_bytes}")
    enabled = supported() if enabled is None else enabled
    seg: _Segment | None = None
    ok, path, msg = False, None, None
    try:
        if rank == 0 and enabled and os.path.isdir("/dev/shm"):
            path = os.path.join("/dev/shm", f"splash-comm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    size = _Segment.nbytes(world, slot_bytes, mail_bytes)
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)
                    seg = _Segment(fd, world, slot_bytes, mail_bytes)
                finally:
                    os.close(fd)
                token = np.frombuffer(os.urandom(16), dtype=np.int64)
                seg.token[:] = token
                msg = (path, token.tolist(), slot_bytes, _boot_id(), mail_bytes)
            except OSError:
                seg, msg = None, None
        out = [msg]
        dist.broadcast_object_list(out, src=0, group=control_group)
        msg = out[0]
        if (enabled and msg is not None and rank != 0 and msg[2] == slot_bytes and msg[3] == _boot_id()
                and msg[4] == mail_bytes):
            try:
                fd = os.open(msg[0], os.O_RDWR)
                try:
                    seg = _Segment(fd, world, slot_bytes, mail_bytes)
                finally:
                    os.close(fd)
            except (OSError, ValueError):
                seg = None
        if seg is not None and msg is not None:
            ok = seg.token.tolist() == msg[1]
            if ok:
                seg.pids[rank] = os.getpid()
        mine = (ok, _pid_ns())
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine, group=control_group)
    finally:
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
    if not all(e[0] for e in every):
        if seg is not None:
            seg.close()
        return None
    comm = ShmCommunicator(seg, group, rank, world, control_group, timeout_s)
    comm.check_pids = len({e[1] for e in every}) == 1  # pids are comparable within one PID namespace
    return comm
