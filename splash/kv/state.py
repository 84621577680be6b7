"""Per-request state of KDA layers (Kimi-Linear hybrids): one rank's slot tensors, rank 0's slot free
list, and a step's view of its slots.

Unlike the latent, a KDA request's state does not grow with its context: per KDA layer a recurrent
state `S [H_held, d_k, d_v]` and a conv window `[3 * H_held * d, K - 1]` (the last K-1 q/k/v inputs).
A rank holds them for `num_slots` requests, allocated once (`StatePool`); a request holds one slot,
the same index in every KDA layer, from admission to finish / abort / preemption (`SlotAllocator` on
rank 0, beside the page allocators; the slot id travels in the step plan, `SeqSlice.slot`, as page ids
do). A slice that starts at position 0 (a fresh request, or a preempted one recomputing from its
tokens) has its slot zeroed at the start of the step (`StatePool.step`), so a slot never leaks a
previous holder's state. The recurrent state is float64 for a float64 model, else float32 (bf16
models too, as vLLM keeps it); the conv window is in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from splash.core.config import ConfigError, ModelConfig
from splash.model.kda import core_dtype


class OutOfSlots(RuntimeError):
    """Raised when a slot is asked for with none free; callers check `num_free` first."""


class SlotAllocator:
    """Rank 0's free list of state slots (LIFO, like the page lists)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are taken")
        s = self._free.pop()
        self._used[s] = True
        return s

    def free(self, slot: int) -> None:
        if slot < 0:
            return
        if not self._used[slot]:
            raise RuntimeError(f"state slot {slot} freed twice (scheduler bookkeeping bug)")
        self._used[slot] = False
        self._free.append(slot)


class StatePool:
    """One rank's KDA state: recurrent [L_kda, slots, H_held, d, d] and conv [L_kda, slots, 3*H_held*d,
    K-1], indexed by model layer id through `layer(i)`."""

    def __init__(self, layers: Sequence[int], num_slots: int, heads: int, head_dim: int, conv_kernel: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if num_slots < 1:
            raise ConfigError(f"a KDA model needs at least one state slot (got {num_slots})")
        self.layers = tuple(layers)
        self._row = {layer: k for k, layer in enumerate(self.layers)}
        self.num_slots, self.heads, self.head_dim, self.conv_kernel = num_slots, heads, head_dim, conv_kernel
        self.dtype, self.state_dtype = dtype, core_dtype(dtype)
        self.device = torch.device(device or "cpu")
        self._shapes = ((len(self.layers), num_slots, heads, head_dim, head_dim),
                        (len(self.layers), num_slots, 3 * heads * head_dim, conv_kernel - 1))
        self.recurrent = torch.zeros(self._shapes[0], dtype=self.state_dtype, device=self.device)
        self.conv = torch.zeros(self._shapes[1], dtype=dtype, device=self.device)

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
        return [self.recurrent, self.conv]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [slots, H, d, d], conv [slots, C, K-1]) of model layer i (views)."""
        k = self._row[i]
        return self.recurrent[k], self.conv[k]

    def zero(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Forget the state of `slots` in every layer."""
        idx = slots if isinstance(slots, torch.Tensor) else torch.tensor(list(slots), dtype=torch.long)
        if idx.numel():
            idx = idx.to(self.device)
            self.recurrent.index_fill_(1, idx, 0)
            self.conv.index_fill_(1, idx, 0)

    def release(self) -> tuple[torch.Size, ...]:
        """Free the tensors (memory release for RL); `restore` gives zeroed ones back."""
        shapes = tuple(t.shape for t in self.tensors())
        self.recurrent = torch.empty(0, dtype=self.state_dtype, device=self.device)
        self.conv = torch.empty(0, dtype=self.dtype, device=self.device)
        return shapes

    def restore(self, shapes: tuple[torch.Size, ...] | None = None) -> None:
        rec, conv = shapes or self._shapes
        self.recurrent = torch.zeros(rec, dtype=self.state_dtype, device=self.device)
        self.conv = torch.zeros(conv, dtype=self.dtype, device=self.device)

    def step(self, seqs: Sequence[Any], device: torch.device | None = None) -> StateStep:
        """The step's view of its slots (`seqs`: the context's SliceCtx, each with `slot`), after zeroing
        the slots of slices that start at position 0."""
        return StateStep(self, seqs, device or self.device)


class StateStep:
    """Which rows of a step read which slot: the decode rows (one row per slice, batched: `dec_rows`,
    `dec_slots`, None when there are none) and the prefill chunks (`prefill`: (rows, slot) per slice,
    run one by one). Built once per step, shared by every KDA layer."""

    __slots__ = ("pool", "dec_rows", "dec_slots", "prefill")

    def __init__(self, pool: StatePool, seqs: Sequence[Any], device: torch.device) -> None:
        self.pool = pool
        dec_r, dec_s, fresh = [], [], []
        self.prefill: list[tuple[slice, int]] = []
        for s in seqs:
            if s.slot < 0 or s.slot >= pool.num_slots:
                raise RuntimeError(f"request {s.req_id} has state slot {s.slot} on a pool of "
                                   f"{pool.num_slots} (a KDA model's slice must carry its request's slot)")
            if s.start == 0:
                fresh.append(s.slot)
            if s.num_new == 1:
                dec_r.append(s.row_start)
                dec_s.append(s.slot)
            else:
                self.prefill.append((s.rows, s.slot))
        if len(set(dec_s)) != len(dec_s):
            raise RuntimeError("two slices of one step share a state slot")
        pool.zero(fresh)
        self.dec_rows = self.dec_slots = None
        if dec_r:
            self.dec_rows = torch.tensor(dec_r, dtype=torch.long).to(device)
            self.dec_slots = torch.tensor(dec_s, dtype=torch.long).to(device)
