"""A rank's side of a live layout switch: move each layer's state while the step computes.

`SwitchExecutor(plan, model, pool, comm)` runs one `SwitchPlan` on this rank. `comm` should be the
switch communicator (`grid.switch`, its own process group) so that transfers never interleave with
the step's own collectives on the data-plane group.

Overlapped mode (the paper's §4.1): `start()` launches layer 0's transfers; the model's layer loop
calls `before_layer(i)` (through `SwitchLayout`) which waits for layer i's state, installs it (the
destination head blocks via `MLA.set_heads`, which also drops the old projection replicas of that
layer; received KV rows written into their destination pages), then launches layer i+1's transfers
asynchronously, so layer i computes in the destination layout while layer i+1 is in flight and at
most one layer is ever in transit. Blocking mode: `start()` moves and installs every layer first.
`finish()` completes whatever the forward did not reach and retires this rank's old pages.

Per layer: weights move by one all-gather of every rank's head blocks (q_b, w_uk, w_uv, o) into a
replicated layout, or are sliced locally into a sharded one; KV moves by one variable all-to-all
carrying only the valid tokens of each moved page, every per-token store of the layer side by side
(the latent and, in a DSA model, the indexer's keys: `KVPool.read_rows`); an all-gather into TP is
the all-to-all in which each holder sends to every non-holder. So the bytes counted per (op,
"switch.w.i" / "switch.kv.i") equal the manifest's, layer by layer. On CUDA the transfers are issued
from a side stream.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from splash.attention.registry import row
from splash.switch.plan import SwitchPlan

WEIGHT_KEYS = ("q_b", "w_uk", "w_uv", "o")
HEAD_DIM = {"q_b": 0, "w_uk": 0, "w_uv": 0, "o": 1}  # the head axis of each block (see MLA.head_tensors)


def switch_tag(kind: str, layer: int) -> str:
    """CommStats tag of a switch transfer: kind "w" (weights) or "kv"."""
    return f"switch.{kind}.{layer}"


@dataclass
class SwitchResult:
    """What one rank did: pages it retired (rank 0 hands them to `SwitchPlanner.commit`) and timings."""

    freed: list[int]
    wait_s: list[float] = field(default_factory=list)  # per layer: blocked on its transfer (CUDA: +install)
    total_s: float = 0.0  # start() .. finish()
    max_in_flight: int = 0  # layers whose transfers were in flight at once (1 in overlapped mode)
    # CUDA only: the compute stream's time in the switch (its stalls on transfers plus the installs),
    # timed with events. On CUDA a wait only enqueues, so the host clock would time the enqueue.
    exposed_gpu_s: float | None = None


def _slots(pairs: list[np.ndarray], col: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Flat pool slots of the valid tokens of each page in column `col` (0: the sender's pages, 1: the
    receiver's) of the plan's [k, 3] pair arrays, in order. A few array ops, no per-page Python: a
    switch moves hundreds of pages and this runs on the step's critical path."""
    if not pairs:
        return torch.zeros(0, dtype=torch.long, device=device)
    pn = np.concatenate(pairs)
    pages, counts = pn[:, col], pn[:, 2]
    # slot = page * P + (offset of the token within its page's run)
    starts = np.repeat(pages * page_size - (np.cumsum(counts) - counts), counts)
    return torch.from_numpy(starts + np.arange(len(starts), dtype=np.int64)).to(device)


class SwitchExecutor:
    def __init__(self, plan: SwitchPlan, model: Any, pool: Any, comm: Any, *,
                 poison_freed: bool = False) -> None:
        self.plan, self.model, self.pool, self.comm = plan, model, pool, comm
        self.poison_freed = poison_freed
        me, T = comm.rank, comm.world
        if T != plan.world:
            raise ValueError(f"switch plan is for {plan.world} ranks, the communicator has {T}")
        self.rank = me
        self.attn = [layer.self_attn for layer in model.layers]
        if len(self.attn) != plan.num_layers or pool.num_layers != plan.num_layers:
            raise ValueError(f"switch plan has {plan.num_layers} layers, the model {len(self.attn)}, "
                             f"the KV pool {pool.num_layers}")
        src = range(*plan.src_heads[me])
        for i, mla in enumerate(self.attn):
            if mla.heads != src:
                raise RuntimeError(f"rank {me}, layer {i}: holds heads {mla.heads}, the switch "
                                   f"{plan.src}->{plan.dst} expects {src}; the model is not in the "
                                   "source layout")
        self.dst_heads = range(*plan.dst_heads[me])
        P, dev = plan.page_size, pool.device
        pairs = plan.kv_pairs
        self.send_counts = plan.kv_send_tokens(me)
        self.recv_counts = plan.kv_recv_tokens(me)
        self.send_slots = _slots([pairs[me, j] for j in range(T) if (me, j) in pairs], 0, P, dev)
        self.recv_slots = _slots([pairs[s, me] for s in range(T) if (s, me) in pairs], 1, P, dev)
        self.moves_kv = plan.moves_kv
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._handles: dict[int, tuple[Any, Any]] = {}
        self._launched = 0
        self._installed = 0
        self._t0: float | None = None
        self._events: dict[int, tuple[Any, Any]] = {}  # CUDA: layer -> (before its waits, after its install)
        self.result = SwitchResult(freed=[], wait_s=[0.0] * plan.num_layers)

    # ---- the protocol ---------------------------------------------------------------------------
    def start(self) -> None:
        """Launch layer 0's transfers (overlapped), or move and install every layer (blocking)."""
        if self._t0 is not None:
            raise RuntimeError("SwitchExecutor.start() called twice")
        self._t0 = time.perf_counter()
        if self.plan.mode == "blocking":
            for i in range(self.plan.num_layers):
                self._launch(i)
                self._install(i)
        elif self.plan.num_layers:
            self._launch(0)

    def before_layer(self, i: int) -> None:
        """Called right before layer i's attention: its state must be in place when this returns."""
        if self._t0 is None:
            raise RuntimeError("SwitchExecutor.start() must run before the switching step's forward")
        if self.plan.mode == "blocking":
            return
        if i != self._installed:
            raise RuntimeError(f"layer {i} reached while layer {self._installed} is the next to switch; "
                               "layers must run in order, once")
        if self._launched == i:
            self._launch(i)
        self._install(i)
        if i + 1 < self.plan.num_layers:
            self._launch(i + 1)

    def finish(self) -> SwitchResult:
        """Switch any layer the forward did not reach, retire this rank's old pages, report."""
        if self._t0 is None:
            self.start()
        while self._installed < self.plan.num_layers:
            if self._launched == self._installed:
                self._launch(self._installed)
            self._install(self._installed)
        freed = list(self.plan.frees[self.rank])
        if self.poison_freed and freed and self.pool.data.is_floating_point():
            # Debug aid: any later read of a retired page (of any store) turns into NaN logits.
            self.pool.poison(torch.tensor(freed, dtype=torch.long, device=self.pool.device))
        if hasattr(self.model, "attn_sharded"):
            self.model.attn_sharded = row(self.plan.dst).shards_projections and self.plan.world > 1
        self.result.freed = freed
        if self._events:  # the step's end syncs anyway; this sync lets the events be read now
            last = self._events[max(self._events)][1]
            last.synchronize()
            for i, (a, b) in self._events.items():
                self.result.wait_s[i] = a.elapsed_time(b) / 1e3
            self.result.exposed_gpu_s = float(sum(self.result.wait_s))
        self.result.total_s = time.perf_counter() - self._t0  # type: ignore[operator]
        return self.result

    # ---- one layer ------------------------------------------------------------------------------
    def _side(self) -> contextlib.AbstractContextManager:
        if self._stream is None:
            return contextlib.nullcontext()
        # The side stream must see everything the compute stream wrote before (e.g. earlier layers' KV).
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)

    def _launch(self, i: int) -> None:
        hw = hk = None
        with self._side():
            if self.plan.weight_op == "gather":
                blocks = self.attn[i].head_tensors()
                flat = torch.cat([blocks[k].reshape(-1) for k in WEIGHT_KEYS])
                hw = self.comm.all_gather_async(flat, switch_tag("w", i))
            if self.moves_kv:
                rows = self.pool.read_rows(i, self.send_slots)  # every per-token store of layer i
                hk = self.comm.all_to_all_var_async(rows, self.send_counts, switch_tag("kv", i),
                                                    self.recv_counts)
        self._handles[i] = (hw, hk)
        self._launched += 1
        self.result.max_in_flight = max(self.result.max_in_flight, self._launched - self._installed)

    def _install(self, i: int) -> None:
        hw, hk = self._handles.pop(i)
        t0 = time.perf_counter()
        before = None
        if self._stream is not None:
            before = torch.cuda.Event(enable_timing=True)
            before.record(torch.cuda.current_stream(self._stream.device))
        gathered = hw.wait() if hw is not None else None
        received = hk.wait() if hk is not None else None
        if self._stream is not None:
            cur = torch.cuda.current_stream(self._stream.device)
            cur.wait_stream(self._stream)
            for t in (gathered, received):
                if t is not None:
                    t.record_stream(cur)  # allocated on the side stream, consumed on this one
        self.result.wait_s[i] = time.perf_counter() - t0
        mla = self.attn[i]
        if self.plan.weight_op == "gather":
            mla.set_heads(self.dst_heads, self._unpack(mla, gathered))
        elif self.plan.weight_op == "slice":
            # clone: a view would keep the whole replica alive, and retiring it is the point
            mla.set_heads(self.dst_heads, {k: v.clone() for k, v in mla.head_tensors(self.dst_heads).items()})
        if received is not None:
            self.pool.write_rows(i, self.recv_slots, received)
        if before is not None:
            after = torch.cuda.Event(enable_timing=True)
            after.record(torch.cuda.current_stream(self._stream.device))  # type: ignore[union-attr]
            self._events[i] = (before, after)
        self._installed += 1

    @staticmethod
    def _unpack(mla: Any, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
        """[T, n] flat head blocks in rank order (rank r = head slice r) -> full blocks of every head."""
        own = mla.head_tensors()
        sizes = [own[k].numel() for k in WEIGHT_KEYS]
        parts = [row.split(sizes) for row in gathered]
        return {k: torch.cat([p[n].view(own[k].shape) for p in parts], dim=HEAD_DIM[k])
                for n, k in enumerate(WEIGHT_KEYS)}
