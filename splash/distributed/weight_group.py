"""The trainer's weight-update group: a process group an RL trainer shares with the engine's ranks.

SGLang's `init_weights_update_group` / `update_weights_from_distributed` protocol: the trainer is
rank 0 of a group of `world_size` processes and every engine rank joins as `rank_offset + its rank`;
the trainer then broadcasts full tensors from rank 0. The group is built from its own TCP store
(`master_address:master_port`, keys under `group_name`), never from the default process group, so it
is separate from the engine's data, control and switch groups and its failure cannot break them.
Gloo on CPU, NCCL on GPU. The trainer side uses the same two calls (`join_group`, `broadcast`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("gloo", "nccl")


@dataclass
class WeightGroup:
    """One joined weight-update group (this process's membership)."""

    name: str
    rank: int
    world: int
    backend: str
    pg: Any
    store: Any

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Receive (or, on `src`, send) `t` in place from group rank `src`."""
        work = self.pg.broadcast([t], _bcast_opts(src))
        work.wait()
        return t

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a peer gone already; nothing to release
                pass
        self.pg = None
        self.store = None


def _bcast_opts(src: int) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = int(src)
    opts.rootTensor = 0
    return opts


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = 600.0, device: torch.device | None = None
               ) -> WeightGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` members have joined.

    Raises ValueError for bad arguments and RuntimeError (with the cause) when the rendezvous fails."""
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a weight-update group of {world_size}")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port must be in [1, 65535], got {master_port}")
    td = datetime.timedelta(seconds=float(timeout_s))
    try:
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                              timeout=td, wait_for_workers=False)
        pstore = dist.PrefixStore(f"splash-weights/{group_name}", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(pstore, rank, world_size, td)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            pg = dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    except Exception as e:  # noqa: BLE001 - rendezvous errors come in many types
        raise RuntimeError(f"could not join weight-update group {group_name!r} at {master_address}:"
                           f"{master_port} as rank {rank} of {world_size}: {type(e).__name__}: {e}") from None
    g = WeightGroup(group_name, rank, world_size, backend, pg, store)
    # One collective so every member knows the group is whole before anyone broadcasts weights.
    probe = torch.zeros(1, device=device if backend == "nccl" else "cpu")
    try:
        g.broadcast(probe, 0)
    except Exception as e:  # noqa: BLE001
        g.close()
        raise RuntimeError(f"weight-update group {group_name!r} formed but its first broadcast failed: "
                           f"{type(e).__name__}: {e}") from None
    return g
