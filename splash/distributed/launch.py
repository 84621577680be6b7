"""Starting the T ranks: spawned locally, joined across nodes, or under torchrun.

- `spawn_workers(world, target, args, timeout_s)`: run `target(grid, *args)` on every rank in fresh
  processes and return each rank's result (rank order); a rank that raises, dies or outlives the
  timeout makes the call raise `WorkerError` / `TimeoutError` with that rank's traceback, after the
  other ranks are terminated. Nothing can hang past `timeout_s`.
- `start_workers(...)`: the non-blocking form for a long-lived engine (e.g. rank 0 stays in the
  calling process and serves, ranks 1..T-1 are children); returns a `WorkerGroup` to poll.
- `resolve_launch(...)`: which global ranks this process/node runs and where they meet, from
  `--tp/--nnodes/--node-rank/--dist-init-addr` (SGLang's convention) or torchrun's env vars.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splash import env as splash_env
from splash.distributed.affinity import bind
from splash.distributed.groups import DEFAULT_TIMEOUT_S, init_distributed


class WorkerError(RuntimeError):
    """A rank failed; `rank` and the rank's own `remote_traceback` say where and why."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"rank {rank}: {message}" + (f"\n--- rank {rank} traceback ---\n"
                                                       f"{remote_traceback}" if remote_traceback else ""))
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (for loopback rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---- where ranks meet ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchSpec:
    """This node's share of the rank grid."""

    world: int
    ranks: tuple[int, ...]     # global ranks this node/process runs
    init_method: str           # tcp://HOST:PORT or env://
    nnodes: int = 1
    node_rank: int = 0
    torchrun: bool = False     # this process *is* one rank (started by torchrun)

    @property
    def has_leader(self) -> bool:
        return 0 in self.ranks


def resolve_launch(tp: int | None = None, nnodes: int = 1, node_rank: int = 0,
                   dist_init_addr: str | None = None,
                   env: Mapping[str, str] | None = None) -> LaunchSpec:
    """Work out this node's ranks; raises ValueError with a one-line fix on inconsistent flags."""
    env = splash_env.torchrun() if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and ("TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env):
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        if tp is not None and tp != world:
            raise ValueError(f"--tp {tp} disagrees with torchrun's WORLD_SIZE={world}; drop --tp")
        return LaunchSpec(world=world, ranks=(rank,), init_method="env://", torchrun=True)
    world = 1 if tp is None else int(tp)
    if world < 1:
        raise ValueError(f"--tp must be >= 1, got {world}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
    if world % nnodes:
        raise ValueError(f"--tp {world} ranks cannot be split evenly over --nnodes {nnodes}")
    if nnodes > 1 and not dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (the node-rank-0 machine)")
    if dist_init_addr:
        host, sep, port = dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr {dist_init_addr!r} is not HOST:PORT")
        init = f"tcp://{host}:{int(port)}"
    else:
        init = f"tcp://127.0.0.1:{free_port()}"
    per = world // nnodes
    return LaunchSpec(world=world, ranks=tuple(range(node_rank * per, (node_rank + 1) * per)),
                      init_method=init, nnodes=nnodes, node_rank=node_rank)


# ---- worker processes ---------------------------------------------------------------------------
def _entry(rank: int, world: int, init_method: str, backend: str | None, timeout_s: float,
           threads: int | None, target: Callable[..., Any], args: tuple, results: Any,
           cores: Sequence[int] | None = None, cpu_comm: str = "shm") -> None:
    """Child main: join the grid, run target, post ("ok"|"err", rank, pickled payload)."""
    grid = None
    try:
        bind(cores)
        if threads:
            import torch

            torch.set_num_threads(threads)
        grid = init_distributed(rank, world, init_method, backend=backend, timeout_s=timeout_s,
                                cpu_comm=cpu_comm)
        out = target(grid, *args)
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent, then exit non-zero
        results.put(("err", rank, pickle.dumps((f"{type(e).__name__}: {e}", traceback.format_exc()))))
        raise SystemExit(1) from None
    finally:
        if grid is not None:
            try:
                grid.destroy()
            except Exception:  # noqa: BLE001 - teardown after a peer died must not mask the result
                pass


class WorkerGroup:
    """Spawned ranks of one grid; the parent polls them (never blocks without a deadline)."""

    def __init__(self, procs: dict[int, Any], results: Any) -> None:
        self.procs = procs
        self._results = results
        self.done: dict[int, Any] = {}

    def poll(self) -> None:
        """Collect finished ranks; raise WorkerError for a rank that failed or died silently."""
        self._drain(0.05)
        for rank, p in self.procs.items():
            if rank not in self.done and p.exitcode is not None:
                self._drain(0.5)  # it may have posted just before exiting
                if rank not in self.done:
                    raise WorkerError(rank, f"process exited with code {p.exitcode} without a result")

    def _drain(self, wait_s: float) -> None:
        while True:
            try:
                status, rank, payload = self._results.get(timeout=wait_s)
            except queue.Empty:
                return
            if status == "err":
                msg, tb = pickle.loads(payload)
                raise WorkerError(rank, msg, tb)
            self.done[rank] = pickle.loads(payload)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.procs)

    def alive(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.is_alive()]

    def join(self, timeout_s: float) -> dict[int, Any]:
        """Wait for every rank's result; on failure or timeout terminate all ranks and raise."""
        deadline = time.monotonic() + timeout_s
        try:
            while not self.finished:
                self.poll()
                if time.monotonic() > deadline:
                    missing = sorted(set(self.procs) - set(self.done))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s "
                                       "(hung collective or slow rank); all ranks were terminated")
        except BaseException:
            self.terminate()
            raise
        for p in self.procs.values():
            p.join(timeout=10)
        return self.done

    def terminate(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def start_workers(world: int, target: Callable[..., Any], args: Sequence[Any] = (),
                  ranks: Sequence[int] | None = None, init_method: str | None = None,
                  backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  threads: int | None = None,
                  cores: Mapping[int, Sequence[int]] | None = None, cpu_comm: str = "shm") -> WorkerGroup:
    """Spawn `ranks` (default all) of a `world`-rank grid; each runs `target(grid, *args)`.

    `target` and `args` must be picklable (module-level function). `timeout_s` bounds every
    data-plane collective inside the workers. `cores`: the CPU cores each rank binds itself to
    (`splash.distributed.affinity.plan`); a rank not in it is not bound. `cpu_comm`: the CPU ranks'
    data plane, "shm" or "gloo" (`EngineConfig.cpu_comm`, `init_distributed`).
    """
    ranks = list(range(world)) if ranks is None else list(ranks)
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs: dict[int, Any] = {}
    for r in ranks:
        p = ctx.Process(target=_entry, name=f"splash-rank{r}", daemon=True,
                        args=(r, world, init_method, backend, timeout_s, threads, target,
                              tuple(args), results, (cores or {}).get(r), cpu_comm))
        p.start()
        procs[r] = p
    return WorkerGroup(procs, results)


def spawn_workers(world: int, target: Callable[..., Any], args: Sequence[Any] = (),
                  timeout_s: float = 120.0, init_method: str | None = None,
                  backend: str | None = None, threads: int | None = 1,
                  collective_timeout_s: float | None = None, cpu_comm: str = "shm") -> list[Any]:
    """Run `target(grid, *args)` on `world` fresh ranks; return results in rank order.

    `timeout_s` bounds the whole run; `collective_timeout_s` (default: `timeout_s`) bounds each
    collective, so a rank waiting on a hung peer raises in that rank with its own traceback.
    """
    group = start_workers(world, target, args, init_method=init_method, backend=backend,
                          timeout_s=collective_timeout_s or timeout_s, threads=threads, cpu_comm=cpu_comm)
    done = group.join(timeout_s)
    return [done[r] for r in range(world)]
