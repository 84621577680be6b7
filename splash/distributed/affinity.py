"""Which CPU cores each of a node's ranks runs on (gloo/CPU only).

Ranks that share a node's cores float between them (free for the kernel to move onto each other's
core); measured on the 2-core machine at T=2 (`bench rollout`, invocations alternating bound and
unbound), binding each rank to its own core made fixed DOP 7% faster (18 runs each), fixed TP 10%
(10 each) and auto 9% (8 each), and DOP's run-to-run spread 12.8% -> 9.5%. So when the node's ranks
times their threads fit the cores this process may use, each local rank gets its own disjoint slice
of them (vLLM's CPU engine binds its threads likewise). When
they do not fit (e.g. T=4 on 2 cores) nothing is bound. `--cpu-bind off` (`SPLASH_CPU_BIND=off`, read
into the engine's config on rank 0) turns binding off; the mode is passed in, never read here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence

ENV = "SPLASH_CPU_BIND"  # (its name, for messages: splash/env.py reads it into EngineConfig.cpu_bind)
ON, OFF = ("auto", "on", "1", ""), ("off", "0", "none")

log = logging.getLogger("splash.distributed")


def plan(local_ranks: int, threads: int, allowed: Iterable[int] | None = None, mode: str = "auto"
         ) -> list[tuple[int, ...]] | None:
    """Cores for each local rank (by position in the node's rank list), or None: binding is off (`mode`,
    the engine's `cpu_bind`), there is one rank (it may use every core), or the ranks' threads would not
    each get a core of their own."""
    mode = mode.strip().lower()
    if mode in OFF:
        return None
    if mode not in ON:
        raise ValueError(f"{ENV}={mode!r}: use 'auto' (bind each rank to its own cores when they fit) or "
                         "'off'")
    if allowed is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        allowed = os.sched_getaffinity(0)
    cores = sorted(allowed)
    threads = max(1, int(threads))
    if local_ranks < 2 or local_ranks * threads > len(cores):
        return None
    return [tuple(cores[i * threads:(i + 1) * threads]) for i in range(local_ranks)]


def for_ranks(ranks: Sequence[int], threads: int | None, backend: str, mode: str = "auto"
              ) -> dict[int, tuple[int, ...]]:
    """`plan` for a node's ranks by global rank ({} where nothing is bound): CPU ranks (gloo) only."""
    cores = plan(len(ranks), threads or 1, mode=mode) if backend == "gloo" else None
    return dict(zip(ranks, cores)) if cores else {}


def bind(cores: Sequence[int] | None) -> tuple[int, set[int]] | None:
    """Run the calling thread (and the threads it starts from now on) on `cores`; what `restore` needs
    to undo it (the thread's id and the cores it ran on before), or None if nothing was bound. Linux
    binds threads: an engine built on its own thread (the server's) binds that thread, not the event
    loop's."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    before = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, set(cores))
    return threading.get_native_id(), before


def restore(bound: tuple[int, set[int]] | None) -> None:
    """Undo `bind` for the thread that bound itself (rank 0's thread outlives its rank group)."""
    if bound is None:
        return
    tid, before = bound
    try:
        os.sched_setaffinity(tid if tid != threading.get_native_id() else 0, before)
    except OSError as e:  # the thread has ended, or the allowed set shrank meanwhile: nothing to undo
        log.debug("CPU affinity of thread %d not restored: %s", tid, e)
