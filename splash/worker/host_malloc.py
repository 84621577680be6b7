"""glibc malloc kept from handing a CPU rank's freed activations back to the kernel between steps.

A CPU forward allocates and frees megabytes of activations per op. glibc returns large freed blocks
to the kernel (mmap'd blocks, and the heap top past its trim threshold), so the next op's tensors
page-fault back in: ~20-30k minor faults per 2048-token prefill step of `small` in bf16 (~40 ms of
CPU time). Raising the mmap threshold to glibc's maximum (32 MiB) and the trim threshold out of reach
keeps such blocks in the heap for reuse, as tcmalloc (which vLLM's CPU backend preloads) does.
Blocks above 32 MiB (KV pools, large weights) are still mapped and unmapped whole, and `give_back`
(called when an RL trainer releases memory) returns every free page of the heap at once.
`--no-malloc-tune` (SPLASH_MALLOC_TUNE=0; `tune(False)`) leaves malloc alone; anything but glibc on
Linux is left alone too.

The Python heap has the same kind of stall: `freeze_heap` moves what start-up built out of the
collector's generations, so a full collection between steps does not scan the model again.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
_state: dict[str, Any] = {}


def _libc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    if "libc" not in _state:
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc (musl has neither)
            libc = None
        _state["libc"] = libc
    return _state["libc"]


def tune(enabled: bool = True) -> bool:
    """Keep freed blocks up to 32 MiB in the heap (once per process; `enabled`: the engine's
    `malloc_tune`); whether malloc is tuned."""
    if "tuned" in _state:
        return _state["tuned"]
    libc = _libc() if enabled else None
    ok = libc is not None and all(libc.mallopt(k, v) == 1 for k, v in (
        (_M_MMAP_THRESHOLD, _MMAP_MAX), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 256 << 20)))
    _state["tuned"] = ok
    return ok


def give_back() -> None:
    """Return the heap's free pages to the kernel now (after releasing memory on request)."""
    libc = _libc() if _state.get("tuned") else None
    if libc is not None:
        libc.malloc_trim(0)


def freeze_heap() -> None:
    """Collect, then freeze every object alive now (a process we own, after it loaded its model): a
    full collection over the start-up heap stalled a step 60-113 ms; frozen, the collector scans only
    what steps and requests make. `thaw_heap` before dropping what was frozen."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_heap` (a frozen cycle is never collected), so a dropped model's cycles can go."""
    gc.unfreeze()
