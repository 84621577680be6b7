"""Per-request state of KDA layers (Kimi-Linear hybrids): one rank's slot tensors, rank 0's slot free
list, and a step's view of its slots.

Unlike the latent, a KDA request's state does not grow with its context: per KDA layer a recurrent
state `S [H_held, d_k, d_v]` and a conv window `[3 * H_held * d, K - 1]` (the last K-1 q/k/v inputs).
A rank holds them for `num_slots` requests, allocated once (`StatePool`); a request holds one slot,
the same index in every KDA layer, from admission to finish / abort / preemption (rank 0's
`SlotAllocator`, splash/kv/slots.py, beside the page allocators; the slot id travels in the step plan,
`SeqSlice.slot`, as page ids do). A slice that starts at position 0 (a fresh request, or a preempted
one recomputing from its tokens) has its slot zeroed at the start of the step (`StatePool.step`), so
a slot never leaks a previous holder's state. The recurrent state is float64 for a float64 model,
else float32 (bf16 models too, as vLLM keeps it); the conv window is in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from splash.core.model_config import ConfigError, ModelConfig
from splash.core.stores import state_dtype

_TORCH = {"fp64": torch.float64, "fp32": torch.float32}


def core_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the delta rule and its state compute in (the core's one rule, `stores.state_dtype`):
    float64 for a float64 model, else float32."""
    return _TORCH[state_dtype(str(dtype).removeprefix("torch."))]


class StatePool:
    """One rank's KDA state, per KDA layer: recurrent [slots, h, d, d] and conv [slots, 3*h*d, K-1] for
    the h heads the rank holds in that layer (`layer(i)` by model layer id). A live switch re-heads one
    layer at a time (`set_layer`): TP/DOP hold H/T heads, DP/CP all H (splash.core.layouts'
    `state_placement`); the slot index space is the same on every rank (rank 0 hands slots out)."""

    def __init__(self, layers: Sequence[int], num_slots: int, heads: int, head_dim: int, conv_kernel: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if num_slots < 1:
            raise ConfigError(f"a KDA model needs at least one state slot (got {num_slots})")
        self.layers = tuple(layers)
        self.num_slots, self.head_dim, self.conv_kernel = num_slots, head_dim, conv_kernel
        self.dtype, self.state_dtype = dtype, core_dtype(dtype)
        self.device = torch.device(device or "cpu")
        self._rec: dict[int, torch.Tensor] = {}
        self._conv: dict[int, torch.Tensor] = {}
        self._heads = {i: heads for i in self.layers}
        for i in self.layers:
            self._rec[i], self._conv[i] = self._zeros(heads)
        # a verify step's snapshot (arm_snapshot): slot -> row, the slots, and layer -> (rec, conv) copies
        self._snap: dict[int, int] = {}
        self._snap_idx = torch.zeros(0, dtype=torch.long, device=self.device)
        self._snap_data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _zeros(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        d, S = self.head_dim, self.num_slots
        return (torch.zeros(S, heads, d, d, dtype=self.state_dtype, device=self.device),
                torch.zeros(S, 3 * heads * d, self.conv_kernel - 1, dtype=self.dtype, device=self.device))

    @property
    def heads(self) -> int:
        """Heads held in the first KDA layer (every layer alike outside a switching step)."""
        return self._heads[self.layers[0]] if self.layers else 0

    def layer_heads(self, i: int) -> int:
        return self._heads[i]

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None, heads: int | None = None) -> StatePool | None:
        """The pool of `cfg`'s KDA layers for `heads` held heads (default all); None for a model
        without KDA layers."""
        if not cfg.is_hybrid:
            return None
        return cls(cfg.kda_layers or (), num_slots, cfg.linear_num_heads if heads is None else heads,
                   cfg.linear_head_dim, cfg.linear_conv_kernel, dtype, device)

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, heads: int | None = None) -> int:
        """Bytes one request's state takes on a rank holding `heads` KDA heads (default all)."""
        if not cfg.is_hybrid:
            return 0
        h = cfg.linear_num_heads if heads is None else heads
        d, k = cfg.linear_head_dim, cfg.linear_conv_kernel
        elem = torch.empty((), dtype=dtype).element_size()
        selem = torch.empty((), dtype=core_dtype(dtype)).element_size()
        return len(cfg.kda_layers or ()) * (h * d * d * selem + 3 * h * d * (k - 1) * elem)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for i in self.layers for t in (self._rec[i], self._conv[i])]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [slots, h, d, d], conv [slots, 3*h*d, K-1]) of model layer i (what a step's KDA
        layer reads and updates: an armed snapshot copies its slots of this layer first)."""
        snap = self._snap_data
        if self._snap and i not in snap:
            idx = self._snap_idx
            snap[i] = (self._rec[i].index_select(0, idx), self._conv[i].index_select(0, idx))
        return self._rec[i], self._conv[i]

    def zero(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Forget the state of `slots` in every layer."""
        idx = slots if isinstance(slots, torch.Tensor) else torch.tensor(list(slots), dtype=torch.long)
        if idx.numel():
            idx = idx.to(self.device)
            for t in self.tensors():
                t.index_fill_(0, idx, 0)

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the state of row src into row dst in every layer, pair by pair in order (the prefix
        cache's snapshots, splash/kv/snapshots.py: a save then a load of the same row may be one batch).
        Each rank copies what it holds of the rows (its heads; DP: the owner's are the ones that count)."""
        for src, dst in pairs:
            for i in self.layers:
                self._rec[i][dst].copy_(self._rec[i][src])
                self._conv[i][dst].copy_(self._conv[i][src])

    # ---- blocks of (slot, head): what a layout switch moves -------------------------------------------
    @property
    def block_width(self) -> int:
        """Values of one (slot, head) block in one layer: d*d recurrent + 3*d*(K-1) conv."""
        d = self.head_dim
        return d * d + 3 * d * (self.conv_kernel - 1)

    def read_blocks(self, i: int, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """[k, block_width] in the state dtype: blocks (slots[j], local head heads[j]) of layer i (the
        conv values widen losslessly: the state dtype is float32 or float64)."""
        rec, conv = self._rec[i], self._conv[i]
        h, d = self._heads[i], self.head_dim
        k = len(slots)
        c = conv.view(conv.shape[0], 3, h, d, -1)[slots, :, heads]  # [k, 3, d, K-1]
        return torch.cat([rec[slots, heads].reshape(k, d * d),
                          c.reshape(k, self.block_width - d * d).to(self.state_dtype)], dim=1)

    def set_layer(self, i: int, heads: int, keep: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                  recv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """Re-head layer i to `heads` held heads: a fresh zeroed state, then `keep` (slots, old local
        heads, new local heads) copied from the old one and `recv` (slots, new local heads, blocks
        [k, block_width]) written; the old tensors are dropped."""
        rec, conv = self._zeros(heads)
        d = self.head_dim
        old_r, old_c = self._rec[i], self._conv[i]
        cv = conv.view(self.num_slots, 3, heads, d, -1)
        if keep is not None and keep[0].numel():
            s, a, b = keep
            rec[s, b] = old_r[s, a]
            oc = old_c.view(self.num_slots, 3, self._heads[i], d, -1)
            cv[s, :, b] = oc[s, :, a]
        if recv is not None and recv[0].numel():
            s, b, x = recv
            k = len(s)
            rec[s, b] = x[:, : d * d].reshape(k, d, d).to(rec.dtype)
            cv[s, :, b] = x[:, d * d:].reshape(k, 3, d, -1).to(conv.dtype)
        self._rec[i], self._conv[i], self._heads[i] = rec, conv, heads

    def release(self) -> tuple[int, ...]:
        """Free the tensors (memory release for RL); `restore` gives zeroed ones back."""
        held = tuple(self._heads[i] for i in self.layers)
        for i in self.layers:
            self._rec[i] = torch.empty(0, dtype=self.state_dtype, device=self.device)
            self._conv[i] = torch.empty(0, dtype=self.dtype, device=self.device)
        return held

    def restore(self, held: tuple[int, ...] | None = None) -> None:
        for k, i in enumerate(self.layers):
            h = self._heads[i] if held is None else held[k]
            self._rec[i], self._conv[i] = self._zeros(h)
            self._heads[i] = h

    # ---- snapshots: a speculative verify step's state before its rows (n-gram drafts on KDA hybrids) ------
    def arm_snapshot(self, slots: Sequence[int]) -> None:
        """Keep a copy of `slots`' state in each layer as the step first reads that layer (`layer`),
        replacing any earlier snapshot: those slots' rows this step are speculative, and
        `restore_snapshot` takes rejected ones back. Taken layer by layer at first use, so in a switching
        step each layer's copy is of the placement the step computes in, the one the restore writes to."""
        self._snap = {int(s): k for k, s in enumerate(slots)}
        self._snap_idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        self._snap_data = {}

    def forget_snapshot(self) -> None:
        self._snap, self._snap_data = {}, {}

    def restore_snapshot(self, slots: Sequence[int]) -> None:
        """Put back the state `arm_snapshot` kept of `slots` (their rows since were rejected drafts)."""
        snap = self._snap
        missing = [s for s in slots if s not in snap]
        if missing or len(self._snap_data) != len(self.layers):
            raise RuntimeError(f"no whole state snapshot of slots {list(slots)} (a restore must follow the "
                               "verify step that took it, with no step in between)")
        src = torch.tensor([snap[s] for s in slots], dtype=torch.long, device=self.device)
        dst = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        for i in self.layers:
            rec, conv = self._snap_data[i]
            self._rec[i].index_copy_(0, dst, rec.index_select(0, src))
            self._conv[i].index_copy_(0, dst, conv.index_select(0, src))

    def step(self, seqs: Sequence[Any], device: torch.device | None = None) -> StateStep:
        """The step's view of its slots (`seqs`: the context's SliceCtx, each with `slot`), after zeroing
        the slots of slices that start at position 0."""
        return StateStep(self, seqs, device or self.device)


class StateStep:
    """Which rows of a step read which slot: the decode rows (one row per slice, batched: `dec_rows`,
    `dec_slots`, None when there are none) and the prefill chunks (`prefill`: (rows, slot) per slice,
    run one by one). Built once per step, shared by every KDA layer; `subset` gives the view of some of
    its slices with their rows renumbered (DP: the rows a rank owns)."""

    __slots__ = ("pool", "dec_rows", "dec_slots", "prefill")

    def __init__(self, pool: StatePool, seqs: Sequence[Any], device: torch.device, zero: bool = True,
                 rows: Sequence[int] | None = None) -> None:
        self.pool = pool
        dec_r, dec_s, fresh = [], [], []
        self.prefill: list[tuple[slice, int]] = []
        at = 0
        for k, s in enumerate(seqs):
            if s.slot < 0 or s.slot >= pool.num_slots:
                raise RuntimeError(f"request {s.req_id} has state slot {s.slot} on a pool of "
                                   f"{pool.num_slots} (a KDA model's slice must carry its request's slot)")
            r0 = s.row_start if rows is None else rows[k]
            if s.start == 0:
                fresh.append(s.slot)
            if s.num_new == 1:
                dec_r.append(r0)
                dec_s.append(s.slot)
            else:
                self.prefill.append((slice(r0, r0 + s.num_new), s.slot))
            at += s.num_new
        if len(set(dec_s)) != len(dec_s):
            raise RuntimeError("two slices of one step share a state slot")
        if zero:
            pool.zero(fresh)
        self.dec_rows = self.dec_slots = None
        if dec_r:
            self.dec_rows = torch.tensor(dec_r, dtype=torch.long).to(device)
            self.dec_slots = torch.tensor(dec_s, dtype=torch.long).to(device)

    def subset(self, seqs: Sequence[Any], device: torch.device) -> StateStep:
        """The slices `seqs` (a subset of the step's, in order) with rows renumbered from 0, as a rank
        computing only those rows sees them (their fresh slots were zeroed by the whole step)."""
        rows, at = [], 0
        for s in seqs:
            rows.append(at)
            at += s.num_new
        return StateStep(self.pool, seqs, device, zero=False, rows=rows)
