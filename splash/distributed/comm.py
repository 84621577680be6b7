"""The one place layers talk to other ranks.

Layouts call a `Communicator`, never torch.distributed: the same layer code then runs on one rank
(`LocalCommunicator`, no torch.distributed at all), on gloo (CPU; `ShmCommunicator` in shm.py moves the
step's tensors through shared memory when the ranks share a host) or on NCCL (CUDA), and every byte
sent is counted per (op, layer tag) in a `CommStats` (see stats.py for the counting convention).

Tensors exchanged are split along dim 0 ("rows"); trailing dims must agree on every rank.
Variable-size collectives take the per-rank row counts when the caller knows them (from the step
plan) so that no extra synchronisation happens; otherwise the counts are exchanged once.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from splash.distributed.stats import CommStats, Tag

OBJ_INLINE = 16 << 10  # broadcast_object bytes that travel in its first (and usually only) broadcast


class Handle:
    """An in-flight collective; `wait()` blocks until it is done and returns its result."""

    def __init__(self, work: Any, finish: Callable[[], Any]) -> None:
        self._work = work
        self._finish = finish
        self._result: Any = None
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._done = True
            self._work = None
        return self._result

    def is_completed(self) -> bool:
        return self._done or self._work is None or bool(self._work.is_completed())


def _done(value: Any) -> Handle:
    return Handle(None, lambda: value)


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one dim-0 row (also right for a tensor with zero rows)."""
    n = 1
    for s in t.shape[1:]:
        n *= int(s)
    return n * t.element_size()


class BaseCommunicator:
    """API shared by the distributed and the one-rank communicator."""

    rank: int
    world: int
    device: torch.device
    stats: CommStats

    # ---- synchronous forms ----------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, tag: Tag = None) -> torch.Tensor:
        """Sum `t` over ranks, in place; returns `t`."""
        return self.all_reduce_async(t, tag).wait()

    def all_gather_var(self, t: torch.Tensor, tag: Tag = None,
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's rows in rank order; `sizes[r]` = rows of rank r if known."""
        return self.all_gather_var_async(t, tag, sizes).wait()

    def all_gather(self, t: torch.Tensor, tag: Tag = None) -> torch.Tensor:
        """Equal-shape gather: returns `[world, *t.shape]` in rank order."""
        return self.all_gather_async(t, tag).wait()

    def all_gather_async(self, t: torch.Tensor, tag: Tag = None) -> Handle:
        return self.all_gather_var_async(t.reshape(1, *t.shape), tag, sizes=[1] * self.world)

    def all_to_all_var(self, t: torch.Tensor, send_counts: Sequence[int], tag: Tag = None,
                       recv_counts: Sequence[int] | None = None) -> torch.Tensor:
        """Send rows `[sum(send_counts[:j]), +send_counts[j])` of `t` to rank j; returns the rows
        received, concatenated in source-rank order. `recv_counts[j]` = rows rank j sends me."""
        return self.all_to_all_var_async(t, send_counts, tag, recv_counts).wait()

    # ---- to implement ---------------------------------------------------------------------------
    def all_reduce_async(self, t: torch.Tensor, tag: Tag = None) -> Handle:
        raise NotImplementedError

    def all_gather_var_async(self, t: torch.Tensor, tag: Tag = None,
                             sizes: Sequence[int] | None = None) -> Handle:
        raise NotImplementedError

    def all_to_all_var_async(self, t: torch.Tensor, send_counts: Sequence[int], tag: Tag = None,
                             recv_counts: Sequence[int] | None = None) -> Handle:
        raise NotImplementedError

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def _check_counts(self, counts: Sequence[int], what: str) -> list[int]:
        c = [int(x) for x in counts]
        if len(c) != self.world or any(x < 0 for x in c):
            raise ValueError(f"{what} must list {self.world} non-negative row counts, got {c}")
        return c


class LocalCommunicator(BaseCommunicator):
    """World of one: every collective is the identity (and sends no bytes)."""

    def __init__(self, device: torch.device | str = "cpu", stats: CommStats | None = None) -> None:
        self.rank, self.world = 0, 1
        self.device = torch.device(device)
        self.stats = stats if stats is not None else CommStats()

    def all_reduce_async(self, t: torch.Tensor, tag: Tag = None) -> Handle:
        self.stats.record("all_reduce", tag, 0)
        return _done(t)

    def all_gather_var_async(self, t: torch.Tensor, tag: Tag = None,
                             sizes: Sequence[int] | None = None) -> Handle:
        if sizes is not None and self._check_counts(sizes, "sizes")[0] != t.shape[0]:
            raise ValueError(f"sizes {list(sizes)} disagree with the {t.shape[0]} rows given")
        self.stats.record("all_gather", tag, 0)
        return _done(t)

    def all_to_all_var_async(self, t: torch.Tensor, send_counts: Sequence[int], tag: Tag = None,
                             recv_counts: Sequence[int] | None = None) -> Handle:
        if self._check_counts(send_counts, "send_counts")[0] != t.shape[0]:
            raise ValueError(f"send_counts {list(send_counts)} disagree with the {t.shape[0]} rows")
        self.stats.record("all_to_all", tag, 0)
        return _done(t)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


class Communicator(BaseCommunicator):
    """Collectives over one process group (data plane) plus a gloo group for control messages.

    `group` carries tensors on `device` (NCCL on CUDA, gloo on CPU); `control_group` (gloo, CPU
    tensors) carries pickled objects such as step plans. `rank`/`world` are ranks in `group`.
    """

    def __init__(self, group: Any, rank: int, world: int, device: torch.device | str,
                 control_group: Any = None, stats: CommStats | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
        self._all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.rank, self.world = int(rank), int(world)
        self.device = torch.device(device)
        self.stats = stats if stats is not None else CommStats()
        self._obj_head = torch.zeros(8 + OBJ_INLINE, dtype=torch.uint8)  # broadcast_object's buffer

    # ---- tensors --------------------------------------------------------------------------------
    def all_reduce_async(self, t: torch.Tensor, tag: Tag = None) -> Handle:
        nbytes = t.numel() * t.element_size()
        self.stats.record("all_reduce", tag, 2 * (self.world - 1) * nbytes // self.world)
        if self.world == 1:
            return _done(t)
        buf = t if t.is_contiguous() else t.contiguous()  # gloo reduces numel elements from data_ptr
        work = self._dist.all_reduce(buf, group=self.group, async_op=True)
        return Handle(work, lambda: t if buf is t else t.copy_(buf))

    def all_gather_var_async(self, t: torch.Tensor, tag: Tag = None,
                             sizes: Sequence[int] | None = None) -> Handle:
        t = t.contiguous()
        n = int(t.shape[0])
        if sizes is None:
            sizes = self._gather_counts(n)
        sizes = self._check_counts(sizes, "sizes")
        if sizes[self.rank] != n:
            raise ValueError(f"rank {self.rank}: sizes say {sizes[self.rank]} rows, tensor has {n}")
        self.stats.record("all_gather", tag, n * _row_bytes(t) * (self.world - 1))
        if self.world == 1:
            return _done(t)
        # Backends gather equal-sized buffers only: pad every rank to the largest, then cut.
        m = max(sizes)
        if m == 0:
            return _done(t.new_empty((0, *t.shape[1:])))
        buf = t if n == m else torch.cat([t, t.new_zeros((m - n, *t.shape[1:]))])
        out = t.new_empty((self.world * m, *t.shape[1:]))
        work = self._all_gather_single(out, buf, group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            if all(s == m for s in sizes):
                return out
            return torch.cat([out[r * m: r * m + s] for r, s in enumerate(sizes)])

        return Handle(work, finish)

    def all_to_all_var_async(self, t: torch.Tensor, send_counts: Sequence[int], tag: Tag = None,
                             recv_counts: Sequence[int] | None = None) -> Handle:
        send = self._check_counts(send_counts, "send_counts")
        if sum(send) != t.shape[0]:
            raise ValueError(f"send_counts {send} sum to {sum(send)}, tensor has {t.shape[0]} rows")
        if recv_counts is None:
            recv_counts = self._exchange_counts(send)
        recv = self._check_counts(recv_counts, "recv_counts")
        if recv[self.rank] != send[self.rank]:
            raise ValueError(f"rank {self.rank}: keeps {send[self.rank]} rows but expects "
                             f"{recv[self.rank]} from itself; the row counts disagree")
        rb = _row_bytes(t)
        self.stats.record("all_to_all", tag, (sum(send) - send[self.rank]) * rb)
        if self.world == 1:
            return _done(t)
        t = t.contiguous()
        out = t.new_empty((sum(recv), *t.shape[1:]))
        work = self._dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send,
                                            group=self.group, async_op=True)
        return Handle(work, lambda: out)

    def _gather_counts(self, n: int) -> list[int]:
        """All ranks' row counts (one small collective)."""
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self._all_gather_single(out, mine, group=self.group)
        return [int(x) for x in out.tolist()]

    def _exchange_counts(self, send: list[int]) -> list[int]:
        """recv[j] = rows rank j will send me (one small all-to-all)."""
        s = torch.tensor(send, dtype=torch.int64, device=self.device)
        r = torch.empty_like(s)
        self._dist.all_to_all_single(r, s, group=self.group)
        return [int(x) for x in r.tolist()]

    # ---- control plane --------------------------------------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Send a picklable object from `src` to every rank (e.g. the step plan); returns it.

        One broadcast of a fixed buffer (length + the first OBJ_INLINE bytes) carries a typical step
        plan whole; only a larger object needs a second broadcast for the rest. On gloo every
        collective costs a fixed ~0.5 ms whatever its size, so this halves the per-step control cost."""
        dist = self._dist
        head = self._obj_head
        if self.rank == src:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(payload)
            head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            k = min(n, OBJ_INLINE)
            head[8:8 + k] = torch.frombuffer(bytearray(payload[:k]), dtype=torch.uint8)
            self.stats.record("broadcast_object", None, n * (self.world - 1))
        dist.broadcast(head, group=self.control_group, group_src=src)
        n = int(head[:8].view(torch.int64).item())
        if n > OBJ_INLINE:
            if self.rank == src:
                rest = torch.frombuffer(bytearray(payload[OBJ_INLINE:]), dtype=torch.uint8)
            else:
                rest = torch.empty(n - OBJ_INLINE, dtype=torch.uint8)
            dist.broadcast(rest, group=self.control_group, group_src=src)
        if self.rank == src:
            return obj
        data = head[8:8 + min(n, OBJ_INLINE)].numpy().tobytes()
        if n > OBJ_INLINE:
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order (diagnostics and tests; pickles over gloo)."""
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def barrier(self) -> None:
        self._dist.barrier(group=self.control_group)
