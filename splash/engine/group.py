"""The T ranks of an engine, seen from rank 0: start them, talk to them, notice when one dies, stop them.

Rank 0 runs in the calling process (scheduler, allocators, sampling, server); the other ranks on this
node are spawned processes running `worker_main`; ranks on other nodes are started there by
`run_worker_node` (`--nnodes N --node-rank R --dist-init-addr HOST:PORT`), and under torchrun each
process is one rank. Everything is started once and reused: an engine is *loaded* onto the group (a
"load" plan), so benchmarks and tests can run several layouts or models without respawning.

Failure is loud and bounded: before every message rank 0 checks that its spawned workers are alive
(a dead one raises WorkerError with the worker's traceback); a peer that dies mid-step breaks the
gloo/NCCL connection, and one that hangs makes rank 0's next plan broadcast (rank 0's control group
has the same `timeout_s`) or data-plane collective time out. Either way the group is marked failed
and every later use raises at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import threading
import time
import weakref
from typing import Any

from splash.config import EngineConfig
from splash.distributed import affinity
from splash.distributed.groups import DEFAULT_TIMEOUT_S, check_devices, init_distributed, pick_backend
from splash.distributed.launch import LaunchSpec, WorkerError, WorkerGroup, resolve_launch, start_workers
from splash.runtime_spec import RuntimeSpec
from splash.step.plan import StepPlan, control_plan
from splash.worker.load import RankFacts
from splash.worker.loop import (
    WorkerState,
    load_reply,
    set_data_timeout,
    stats_reply,
    tables_reply,
    unload,
    worker_main,
)

log = logging.getLogger("splash.engine")


START_TIMEOUT_S = 300.0


class GroupFailed(RuntimeError):
    """The rank group broke (a rank died, hung or raised); the engine cannot run any more steps."""


def start_timeout(timeout_s: float) -> float:
    """Timeout for forming the group: spawned ranks import torch first, which can take a while."""
    return max(float(timeout_s), START_TIMEOUT_S)


def _option(value: str | None, name: str) -> str:
    """A CPU option the group was given, else what an EngineConfig made now says (its default, or the
    environment's override: read here on rank 0, as when any config is made, and passed to the ranks)."""
    return value if value is not None else getattr(EngineConfig.from_kwargs(), name)


def default_threads(local_ranks: int) -> int:
    """CPU threads per rank so that this node's ranks share its cores instead of oversubscribing."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


class RankGroup:
    """Rank 0's handle on the group: the grid (torch.distributed groups) and the local workers."""

    def __init__(self, grid: Any, launch: LaunchSpec, workers: WorkerGroup | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.grid = grid
        self.timeout_s = timeout_s
        self.launch = launch
        self.workers = workers
        self.state = WorkerState(grid)  # rank 0's own loaded shard
        self.error: BaseException | None = None
        self.closed = False
        self.owner: Any = None  # the engine currently loaded (a new load replaces it)
        self.bound: Any = None  # rank 0's thread and its CPU cores before it bound itself (to undo)
        ref = weakref.ref(self)
        atexit.register(lambda: (g := ref()) is not None and g.close())

    # ---- start --------------------------------------------------------------------------------------
    @classmethod
    def start(cls, world: int, *, nnodes: int = 1, node_rank: int = 0, dist_init_addr: str | None = None,
              device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              threads: int | None = None, cpu_bind: str | None = None, cpu_comm: str | None = None
              ) -> RankGroup:
        """Spawn this node's worker ranks and join the group as rank 0 (blocks until all ranks meet)."""
        return cls.join(resolve_launch(world, nnodes, node_rank, dist_init_addr), device=device,
                        timeout_s=timeout_s, threads=threads, cpu_bind=cpu_bind, cpu_comm=cpu_comm)

    @classmethod
    def join(cls, launch: LaunchSpec, *, device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
             threads: int | None = None, cpu_bind: str | None = None, cpu_comm: str | None = None
             ) -> RankGroup:
        """`start` from a resolved launch (flags or torchrun's environment). `cpu_bind` / `cpu_comm`: the
        engine's options of those names (None: a config's default or environment override)."""
        cpu_bind, cpu_comm = _option(cpu_bind, "cpu_bind"), _option(cpu_comm, "cpu_comm")
        if not launch.has_leader:
            raise ValueError(f"node {launch.node_rank} runs ranks {list(launch.ranks)} only; rank 0 lives on "
                             "node 0 (start this node with run_worker_node)")
        backend = pick_backend(device)
        check_devices(len(launch.ranks), backend)
        local = [r for r in launch.ranks if r != 0]
        if threads is None and backend == "gloo":
            threads = default_threads(len(launch.ranks))
        if threads and backend == "gloo":
            import torch

            torch.set_num_threads(threads)
        workers = None
        start = start_timeout(timeout_s)
        by_rank = affinity.for_ranks(launch.ranks, threads, backend, cpu_bind)
        if local:
            workers = start_workers(launch.world, worker_main, (timeout_s,), ranks=local,
                                    init_method=launch.init_method, backend=backend, timeout_s=start,
                                    threads=threads, cores=by_rank, cpu_comm=cpu_comm)
        try:
            grid = _watching(workers, lambda: init_distributed(0, launch.world, launch.init_method,
                                                               backend=backend, timeout_s=start,
                                                               control_timeout_s=start, cpu_comm=cpu_comm))
        except BaseException:
            if workers is not None:
                _raise_worker_error(workers)
                workers.terminate()
            raise
        # Rank 0's control group gets the data-plane timeout too: a plan a hung rank never takes fails
        # the send after `timeout_s`. Workers keep the long default: they may wait idle for days.
        set_data_timeout(grid, timeout_s, control=True)
        group = cls(grid, launch, workers, timeout_s)
        # Rank 0 binds itself only now: the spawned ranks imported torch beside it on every core.
        group.bound = affinity.bind(by_rank.get(0))
        if by_rank:
            log.info("ranks bound to CPU cores %s (--cpu-bind off / %s=off to stop)", by_rank, affinity.ENV)
        return group

    @property
    def world(self) -> int:
        return self.grid.world

    @property
    def device(self) -> Any:
        return self.grid.device

    # ---- liveness ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if the group is unusable: closed, failed before, or a local worker has exited."""
        if self.closed:
            raise GroupFailed("the rank group was shut down")
        if self.error is not None:
            raise GroupFailed(f"the rank group failed earlier ({self.error}); restart the engine")
        if self.workers is not None:
            dead = [r for r, p in self.workers.procs.items() if p.exitcode is not None]
            if dead:
                err = _worker_error(self.workers) or WorkerError(
                    dead[0], f"process exited with code {self.workers.procs[dead[0]].exitcode}")
                self.fail(err)
                raise err

    def fail(self, err: BaseException) -> None:
        """Mark the group broken (first error wins) and stop the local workers: nothing can resume."""
        if self.error is None:
            self.error = err
            log.error("rank group failed: %s", err)
        if self.workers is not None:  # no graceful exit to wait for: a hung rank ignores SIGTERM
            for p in self.workers.procs.values():
                if p.is_alive():
                    p.kill()
            for p in self.workers.procs.values():
                p.join(timeout=5)

    def explain(self, err: BaseException) -> BaseException:
        """The most useful error for a failed step: a worker's own traceback when one reported it."""
        if self.workers is not None:
            time.sleep(0.2)  # a worker that raised posts its traceback just before exiting
            werr = _worker_error(self.workers)
            if werr is not None:
                return werr
            dead = [r for r, p in self.workers.procs.items() if p.exitcode is not None]
            if dead:
                code = self.workers.procs[dead[0]].exitcode
                return WorkerError(dead[0], f"process exited with code {code} during a step "
                                            f"({type(err).__name__}: {err})")
        return GroupFailed(f"a collective failed on rank 0 ({type(err).__name__}: {err}); a peer rank "
                           f"died or hung past the {self.timeout_s:g} s collective timeout")

    # ---- messages ------------------------------------------------------------------------------------
    def send(self, plan: StepPlan | bytes | tuple) -> None:
        """Broadcast a control plan or a step message (splash/step/wire.py) to every rank (after
        checking they are alive)."""
        self.check()
        self.grid.comm.broadcast_object(plan, src=0)

    def gather(self, obj: Any) -> list[Any]:
        return self.grid.comm.all_gather_object(obj)

    def guarded(self, fn: Any, *args: Any) -> Any:
        """Run one exchange with the ranks; any failure marks the group failed and raises a clear error."""
        self.check()
        try:
            return fn(*args)
        except (GroupFailed, WorkerError):
            raise
        except Exception as e:
            err = self.explain(e)
            self.fail(err)
            raise err from e
        except BaseException as e:  # Ctrl-C mid-exchange: the ranks are out of step for good
            self.fail(GroupFailed(f"interrupted during an exchange with the ranks ({type(e).__name__})"))
            raise

    def load(self, spec: RuntimeSpec, owner: Any = None) -> list[RankFacts]:
        """Build an engine's shard on every rank from `spec`; returns what each rank measured (rank order)."""
        def run() -> list[RankFacts | dict[str, str]]:
            plan = control_plan("load", layout=spec.layout_name, payload=spec)
            self.send(plan)
            return self.gather(load_reply(self.state, plan))

        replies = self.guarded(run)
        bad = [(r, x["error"]) for r, x in enumerate(replies) if isinstance(x, dict)]
        if bad:
            self.unload()
            from splash.core.model_config import ConfigError

            r, msg = bad[0]
            raise ConfigError(msg if r == 0 else f"rank {r}: {msg}")
        self.owner = owner
        return [x for x in replies if isinstance(x, RankFacts)]

    def unload(self) -> None:
        if self.closed or self.error is not None:
            unload(self.state)
            return
        self.guarded(self.send, control_plan("unload"))
        unload(self.state)
        self.owner = None

    def gather_stats(self) -> list[dict[str, Any]]:
        """Every rank's CommStats (rank order); one control message, only when asked."""
        def run() -> list[dict[str, Any]]:
            self.send(control_plan("stats"))
            return self.gather(stats_reply(self.state))

        return self.guarded(run)

    def gather_tables(self) -> list[dict[int, list[int]]]:
        """Every rank's own page tables {req_id: local pages} (rank order; tests and debugging)."""
        def run() -> list[dict[int, list[int]]]:
            self.send(control_plan("tables"))
            return self.gather(tables_reply(self.state))

        return self.guarded(run)

    # ---- stop ----------------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Tell every rank to exit, wait for the local ones (bounded), tear the groups down."""
        if self.closed:
            return
        self.closed = True
        unload(self.state)
        if self.error is None:
            try:
                self.grid.comm.broadcast_object(control_plan("shutdown"), src=0)
            except Exception as e:  # noqa: BLE001 - peers gone already; still clean up below
                log.warning("could not send shutdown to the ranks: %s", e)
        if self.workers is not None:
            deadline = time.monotonic() + timeout_s
            while self.workers.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.workers.terminate()
            _drain(self.workers)
        try:
            self.grid.destroy()
        except Exception as e:  # noqa: BLE001 - a broken group may not tear down cleanly
            log.warning("rank group teardown: %s", e)
        finally:
            affinity.restore(self.bound)


def _drain(workers: WorkerGroup) -> list[tuple[str, int, bytes]]:
    out = []
    while True:
        try:
            out.append(workers._results.get_nowait())
        except (queue.Empty, OSError, ValueError):
            return out


def _worker_error(workers: WorkerGroup) -> WorkerError | None:
    """The first error a worker posted (its message and traceback), if any."""
    for status, rank, payload in _drain(workers):
        if status == "err":
            msg, tb = pickle.loads(payload)
            return WorkerError(rank, msg, tb)
    return None


def _watching(workers: WorkerGroup | None, join: Any) -> Any:
    """Run `join()` (rank 0's rendezvous) while watching the spawned ranks: one that dies before it
    joins (e.g. a script without a `__main__` guard, whose re-import by the spawned rank fails) would
    otherwise leave rank 0 waiting the whole start-up timeout. The rendezvous runs on a helper thread;
    after such a death it is abandoned (it ends at its own timeout) and the error is raised here."""
    if workers is None:
        return join()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["grid"] = join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="splash-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = [(r, p.exitcode) for r, p in workers.procs.items() if p.exitcode is not None]
        if dead and t.is_alive():
            _raise_worker_error(workers)  # a rank that reported its own error says it best
            rank, code = dead[0]
            raise WorkerError(rank, f"exited with code {code} before joining the group; if your script "
                                    "builds the engine at import time, put that under `if __name__ == "
                                    "\"__main__\":` (spawned ranks re-import the main module)")
    if "error" in out:
        raise out["error"]
    return out["grid"]


def _raise_worker_error(workers: WorkerGroup) -> None:
    time.sleep(0.2)
    err = _worker_error(workers)
    if err is not None:
        workers.terminate()
        raise err


# ---- nodes and processes without rank 0 ---------------------------------------------------------------
def run_worker_node(launch: LaunchSpec, device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                    threads: int | None = None, cpu_bind: str | None = None, cpu_comm: str | None = None
                    ) -> int:
    """Run this node's ranks (none of them rank 0) until rank 0 shuts the group down.

    Under torchrun (or with one rank on this node) the process *is* its rank and runs the loop itself;
    otherwise the node's ranks are spawned and watched. Returns 0 on a clean shutdown; raises
    WorkerError if a rank failed."""
    backend = pick_backend(device)
    check_devices(len(launch.ranks), backend)
    cpu_bind, cpu_comm = _option(cpu_bind, "cpu_bind"), _option(cpu_comm, "cpu_comm")
    if threads is None and backend == "gloo":
        threads = default_threads(len(launch.ranks))
    if len(launch.ranks) == 1:  # torchrun, or a node with one rank: this process is the rank
        import torch

        if threads and backend == "gloo":
            torch.set_num_threads(threads)
        grid = init_distributed(launch.ranks[0], launch.world, launch.init_method, backend=backend,
                                timeout_s=start_timeout(timeout_s), cpu_comm=cpu_comm)
        try:
            worker_main(grid, timeout_s)
        finally:
            grid.destroy()
        return 0
    workers = start_workers(launch.world, worker_main, (timeout_s,), ranks=launch.ranks,
                            init_method=launch.init_method, backend=backend,
                            timeout_s=start_timeout(timeout_s), threads=threads,
                            cores=affinity.for_ranks(launch.ranks, threads, backend, cpu_bind),
                            cpu_comm=cpu_comm)
    try:
        while not workers.finished:
            workers.poll()  # raises WorkerError for a rank that failed (e.g. rank 0 went away)
    finally:
        workers.terminate()
    return 0


def follow_if_worker(config: EngineConfig) -> bool:
    """If this process/node holds no rank 0 (`--node-rank` > 0, or a torchrun rank > 0), serve its
    ranks until rank 0 shuts the group down and return True; otherwise do nothing and return False.
    ValueError (one line) on inconsistent launch options."""
    launch = resolve_launch(config.tp, config.nnodes, config.node_rank, config.dist_init_addr)
    device, timeout_s, threads = config.device, config.collective_timeout_s, config.threads
    if launch.has_leader:
        return False
    log.info("node %d: running ranks %s until rank 0 shuts the group down", launch.node_rank,
             list(launch.ranks))
    run_worker_node(launch, device=device, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, threads=threads,
                    cpu_bind=config.cpu_bind, cpu_comm=config.cpu_comm)
    return True
