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

from splash.core.layouts import Layout
from splash.switch.plan import SwitchPlan

WEIGHT_KEYS = ("q_b", "w_uk", "w_uv", "o")
HEAD_DIM = {"q_b": 0, "w_uk": 0, "w_uv": 0, "o": 1}  # the head axis of each block (see MLA.head_tensors)
# a KDA layer's head blocks in the model dtype (KDA.head_tensors; dt_bias, float32, travels on its own)
KDA_KEYS = ("qkv", "conv", "f_b", "A_log", "b", "g_b", "o")
KDA_HEAD_DIM = {"qkv": 1, "conv": 1, "f_b": 0, "A_log": 0, "b": 0, "g_b": 0, "o": 1}


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
                 poison_freed: bool = False, state: Any = None) -> None:
        self.plan, self.model, self.pool, self.comm = plan, model, pool, comm
        self.poison_freed = poison_freed
        me, T = comm.rank, comm.world
        if T != plan.world:
            raise ValueError(f"switch plan is for {plan.world} ranks, the communicator has {T}")
        self.rank = me
        self.attn = [layer.self_attn for layer in model.attn_layers()]  # (+ served MTP layers)
        self.kda = frozenset(plan.kda_layers)  # a hybrid's KDA layers: weights + request states, no KV
        n_mla = plan.num_layers - len(self.kda)
        if len(self.attn) != plan.num_layers or pool.num_layers != n_mla:
            raise ValueError(f"switch plan has {plan.num_layers} layers ({n_mla} with KV), the model "
                             f"{len(self.attn)}, the KV pool {pool.num_layers}")
        if self.kda and state is None:
            raise ValueError("a hybrid's switch needs the rank's StatePool (state=...)")
        self.state = state
        src = range(*plan.src_heads[me])
        src_k = range(*plan.src_kda_heads[me]) if self.kda else range(0)
        for i, mla in enumerate(self.attn):
            want = src_k if i in self.kda else src
            if mla.heads != want:
                raise RuntimeError(f"rank {me}, layer {i}: holds heads {mla.heads}, the switch "
                                   f"{plan.src}->{plan.dst} expects {want}; the model is not in the "
                                   "source layout")
        self.dst_heads = range(*plan.dst_heads[me])
        if self.kda:
            self._init_state(plan, me, T, state.device)
        P, dev = pool.page_size, pool.device
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

    def _init_state(self, plan: SwitchPlan, me: int, T: int, dev: torch.device) -> None:
        """This rank's state blocks, every KDA layer alike: what it sends (slot, old local head) to each
        rank, what it receives (slot, new local head) from each, and what it keeps."""
        a, b = plan.src_kda_heads[me][0], plan.dst_kda_heads[me][0]
        self.dst_kda_heads = range(*plan.dst_kda_heads[me])
        mv = plan.state_moves if plan.state_moves is not None else np.zeros((0, 4), dtype=np.int64)

        def lt(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(dev)

        out = mv[mv[:, 2] == me]  # sorted by receiver (the plan sorts by sender, receiver, slot, head)
        inn = mv[mv[:, 3] == me]  # sorted by sender
        self.st_send = (lt(out[:, 0]), lt(out[:, 1] - a))
        self.st_send_counts = np.bincount(out[:, 3], minlength=T).tolist()
        self.st_recv = (lt(inn[:, 0]), lt(inn[:, 1] - b))
        self.st_recv_counts = np.bincount(inn[:, 2], minlength=T).tolist()
        keep = plan.state_keep[me] if plan.state_keep else np.zeros((0, 2), dtype=np.int64)
        self.st_keep = (lt(keep[:, 0]), lt(keep[:, 1] - a), lt(keep[:, 1] - b))
        self.st_moves = len(mv) > 0

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
        if self.poison_freed and freed:
            # Debug aid: any later read of a retired page (of any store) turns into NaN logits.
            self.pool.poison(torch.tensor(freed, dtype=torch.long, device=self.pool.device))
        if hasattr(self.model, "attn_sharded"):
            self.model.attn_sharded = Layout.named(self.plan.dst).sharded and self.plan.world > 1
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
        if i in self.kda:
            return self._launch_kda(i)
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

    def _launch_kda(self, i: int) -> None:
        """A KDA layer: its head-sliced weights all-gathered (float32 dt_bias on its own), and the
        request-state blocks of the plan by one variable all-to-all."""
        hw = hs = None
        with self._side():
            if self.plan.weight_op == "gather":
                blocks = self.attn[i].head_tensors()
                flat = torch.cat([blocks[k].reshape(-1) for k in KDA_KEYS])
                dtb = blocks["dt_bias"].reshape(-1).contiguous()
                hw = (self.comm.all_gather_async(flat, switch_tag("w", i)),
                      self.comm.all_gather_async(dtb, switch_tag("w", i)))
            if self.st_moves:
                rows = self.state.read_blocks(i, *self.st_send)
                hs = self.comm.all_to_all_var_async(rows, self.st_send_counts, switch_tag("kv", i),
                                                    self.st_recv_counts)
        self._handles[i] = (hw, hs)
        self._launched += 1
        self.result.max_in_flight = max(self.result.max_in_flight, self._launched - self._installed)

    def _install_kda(self, i: int, hw: Any, hs: Any) -> None:
        kda = self.attn[i]
        if hw is not None:
            flat, dtb = hw[0].wait(), hw[1].wait()
            kda.set_heads(self.dst_kda_heads, self._unpack_kda(kda, flat, dtb))
        elif self.plan.weight_op == "slice":
            kda.set_heads(self.dst_kda_heads,
                          {k: v.clone() for k, v in kda.head_tensors(self.dst_kda_heads).items()})
        received = hs.wait() if hs is not None else None
        if self._stream is not None and received is not None:
            received.record_stream(torch.cuda.current_stream(self._stream.device))
        self.state.set_layer(i, len(self.dst_kda_heads), self.st_keep,
                             (*self.st_recv, received) if received is not None else None)

    @staticmethod
    def _unpack_kda(kda: Any, gathered: torch.Tensor, dt_bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """[T, n] flat KDA head blocks in rank order (+ [T, m] dt_bias) -> full blocks of every head."""
        own = kda.head_tensors()
        sizes = [own[k].numel() for k in KDA_KEYS]
        parts = [row.split(sizes) for row in gathered]
        out = {k: torch.cat([p[n].view(own[k].shape) for p in parts], dim=KDA_HEAD_DIM[k])
               for n, k in enumerate(KDA_KEYS)}
        out["dt_bias"] = torch.cat([r.view(own["dt_bias"].shape) for r in dt_bias], dim=0)
        return out

    def _install(self, i: int) -> None:
        hw, hk = self._handles.pop(i)
        if i in self.kda:
            t0 = time.perf_counter()
            if self._stream is not None:
                torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._install_kda(i, hw, hk)
            self.result.wait_s[i] = time.perf_counter() - t0
            self._installed += 1
            return
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
