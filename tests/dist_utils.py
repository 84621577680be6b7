"""Run a function on T gloo ranks on loopback, in spawned processes, with a hard timeout.

    results = run_ranks(2, my_fn, arg1, arg2)   # my_fn(grid, arg1, arg2) on ranks 0 and 1

`my_fn` must be a module-level function (spawned children import it by name). Each child uses one
thread (the CI machine has 2 cores). A rank that raises makes `run_ranks` raise WorkerError with
that rank's own traceback; a rank that hangs makes it raise TimeoutError after `timeout` seconds,
with every rank terminated - a test can fail, never hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splash.distributed.launch import spawn_workers


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
              cpu_comm: str = "shm") -> list[Any]:
    """`fn(grid, *args)` on ranks 0..world-1 (gloo, CPU; `cpu_comm`: their data plane, shm or gloo);
    results in rank order."""
    return spawn_workers(world, fn, args, timeout_s=timeout, backend="gloo", threads=1, cpu_comm=cpu_comm)
