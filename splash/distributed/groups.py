"""Process groups, built once per process from one rank grid.

One grid = `world` ranks, each with a data-plane group (NCCL on CUDA, gloo on CPU) and a gloo
control-plane group (pickled step plans travel on CPU whatever the accelerator). Every group is
created here at start-up, in the same order on every rank, so no collective ever waits on a group
another rank has not built.

Timeouts: data-plane collectives fail after `timeout_s` (a hung or dead peer raises instead of
hanging); the control plane may legitimately sit idle between requests, so its timeout is separate
(`control_timeout_s`) - keep it long, or have rank 0 send periodic keep-alive plans.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from splash import env
from splash.core.model_config import ConfigError
from splash.distributed import shm
from splash.distributed.comm import BaseCommunicator, Communicator, LocalCommunicator

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


class DistError(RuntimeError):
    """The rank group could not be formed; the message says what to change."""


def parse_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: `device` checked (cpu, cuda or cuda:i, present), or CUDA when there is one."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:INDEX") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use cpu, cuda or cuda:INDEX")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"device {device!r}: this machine (or this torch build) has no CUDA device; "
                              "use --device cpu")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"device {device!r}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")
    return dev


def pick_backend(device: str | None = None) -> str:
    """NCCL when CUDA is present (and not asked for CPU), else gloo."""
    if device is not None and parse_device(device).type == "cpu":
        return "gloo"
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def check_devices(ranks_here: int, backend: str) -> None:
    """NCCL needs one CUDA device per rank on a node (it refuses two ranks on one device, and only
    after every rank has started): say so up front, with what to change."""
    if backend != "nccl":
        return
    found = torch.cuda.device_count()
    if ranks_here > found:
        raise ConfigError(f"{ranks_here} ranks on this node need {ranks_here} CUDA devices (NCCL runs one "
                          f"rank per device), but {found} {'is' if found == 1 else 'are'} visible; run at "
                          f"most {found} ranks per node (--tp, or --nnodes to spread them) or use --device "
                          f"cpu (gloo)")


@dataclass
class RankGrid:
    """This process's place in the group, its device, its groups and its communicator."""

    rank: int
    world: int
    local_rank: int
    backend: str  # "gloo" | "nccl" | "local"
    device: torch.device
    comm: BaseCommunicator
    group: Any = None    # data-plane ProcessGroup (None for world of one)
    control: Any = None  # gloo ProcessGroup for control messages
    _owns_pg: bool = field(default=False, repr=False)
    # Layout-switch transfers (splash/switch) run on their own group so their async collectives never
    # interleave with the step's own collectives; it shares `comm.stats` (tags "switch.*").
    switch: BaseCommunicator | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def destroy(self) -> None:
        """Tear the groups down (safe to call twice, and on a world of one)."""
        if self._owns_pg:
            import torch.distributed as dist

            close = getattr(self.comm, "close", None)
            if close is not None:
                close()

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_pg = False


def local_grid(device: torch.device | str = "cpu") -> RankGrid:
    """A world of one rank: no torch.distributed, the same API."""
    dev = torch.device(device)
    comm = LocalCommunicator(dev)
    return RankGrid(rank=0, world=1, local_rank=0, backend="local", device=dev, comm=comm, switch=comm)


def init_distributed(rank: int, world: int, init_method: str | None = None,
                     backend: str | None = None, local_rank: int | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S,
                     control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
                     switch_group: bool = True, cpu_comm: str = "shm") -> RankGrid:
    """Join (or form) the group of `world` ranks as `rank` and build every group once.

    `init_method`: "tcp://HOST:PORT", "env://" (torchrun: MASTER_ADDR/PORT), or "file://...".
    `backend`: None picks NCCL on CUDA, else gloo. World 1 returns `local_grid()` unless a backend
    is forced (useful to test the distributed path on one process). `switch_group`: also build the
    data-plane group that layout switches transfer on (`grid.switch`). `cpu_comm`: gloo ranks' data plane,
    "shm" (a shared-memory segment where every rank can map one) or "gloo" (`EngineConfig.cpu_comm`).
    """
    if world < 1 or not 0 <= rank < world:
        raise DistError(f"rank {rank} is outside a world of {world} ranks")
    backend = backend or pick_backend()
    if backend not in ("gloo", "nccl"):
        raise DistError(f"unknown backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise DistError("backend nccl needs CUDA, which this machine lacks; use --device cpu (gloo)")
    if local_rank is None:
        local_rank = int(env.text("LOCAL_RANK") or rank)
    if backend == "nccl" and env.is_set("LOCAL_WORLD_SIZE"):  # torchrun: this node's ranks, one each
        check_devices(int(env.text("LOCAL_WORLD_SIZE")), backend)
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world == 1 and init_method is None:
        return local_grid(device)

    import torch.distributed as dist

    if dist.is_initialized():
        raise DistError("torch.distributed is already initialised in this process; "
                        "build the rank grid once per process")
    kw: dict[str, Any] = {}
    if backend == "nccl":
        kw["device_id"] = device
    try:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world, timeout=_td(timeout_s), **kw)
    except (RuntimeError, ValueError) as e:  # e.g. address in use, peers never arrive
        raise DistError(f"rank {rank}/{world}: could not join the group at {init_method}: {e}") from e
    group = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=_td(control_timeout_s))
    comm: BaseCommunicator | None = None
    if backend == "gloo":  # one host's CPU ranks: collectives through shared memory (every rank asks)
        willing = None if cpu_comm == "shm" else False  # (None: where the platform allows)
        comm = shm.attach(group, rank, world, control, timeout_s, enabled=willing)
    if comm is None:
        comm = Communicator(group, rank, world, device, control_group=control)
    switch = None
    if switch_group:
        sw = dist.new_group(backend=backend, timeout=_td(timeout_s))
        switch = Communicator(sw, rank, world, device, control_group=control, stats=comm.stats)
    return RankGrid(rank=rank, world=world, local_rank=local_rank, backend=backend, device=device,
                    comm=comm, group=group, control=control, _owns_pg=True, switch=switch)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))
