"""The one function that builds a rank's share of an engine from the resolved `RuntimeSpec`.

Rank 0 resolves the user's options and the checkpoint once (splash/engine/resolve.py) and sends the spec
to every rank (a "load" plan), so worker ranks, including those on other machines, need no flags of
their own, parse nothing again and cannot disagree with rank 0. Every rank - rank 0 included - then runs
the same `load_rank`, so a rank's shard, pool and layout are built by identical code everywhere; what
it measured comes back as `RankFacts`.

Live switching (auto or a schedule): the KV pool makes room for the projection replicas a switch into
DP/CP gathers. Under a budget it is sized as if the projections were head-sharded (the largest pool),
whatever the start layout, and DP/CP withhold the replicas' pages (splash/switch/replicas.py); without
one, the default pool leaves them free (nothing else would check that they fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from splash.core.model_config import ConfigError
from splash.runtime_spec import RuntimeSpec


@dataclass(frozen=True)
class RankFacts:
    """What one rank measured while loading (rank 0 gathers them from every rank)."""

    pages: int  # its KV pool's pages
    weight_bytes: int  # every tensor its model share holds
    reserve_bytes: int  # the step workspace kept out of the KV budget
    device: str  # where it runs ("cpu", "cuda:1")
    slots: int = 0  # KDA state slots (0: the model keeps no per-request state)
    snapshots: int = 0  # KDA state rows after the slots kept for the prefix cache (splash/kv/snapshots.py)
    state_bytes: int = 0  # what they take
    replica_pages: int = 0  # pages its projection replicas take in DP/CP (a budgeted, switching pool)


@dataclass
class RankState:
    """One rank's built engine share: the runner (model, pool, layout) and what it measured."""

    runner: Any
    facts: RankFacts


def rank_device(spec: RuntimeSpec, grid: Any) -> torch.device:
    """The grid's device (CUDA: one per local rank), which must be of the type rank 0 asked for."""
    if grid.device.type != spec.device:
        raise ConfigError(f"rank {grid.rank} runs on {grid.device.type} but the engine asked for "
                          f"{spec.device}; give every node the same --device")
    return grid.device


def load_rank(spec: RuntimeSpec, grid: Any) -> RankState:
    """Load this rank's model shard for the start layout, size and allocate its KV pool, build its
    runner, all from `spec` (nothing parsed or resolved again)."""
    from splash.attention.kernels import Kernels
    from splash.attention.registry import make_layout
    from splash.kv.pool import KVPool
    from splash.kv.state import StatePool
    from splash.model import load_model
    from splash.model.gemm import set_native, set_upcast
    from splash.worker.runner import ModelRunner
    from splash.worker.sizing import kv_pages, reserve_bytes, weight_bytes

    c, cfg, world, tdtype = spec.config, spec.model, spec.world, spec.dtype
    if c.seed is not None:
        torch.manual_seed(c.seed)
    dev = rank_device(spec, grid)
    if dev.type == "cpu":
        from splash.worker.host_malloc import tune

        tune(c.malloc_tune)  # activations' memory reused across steps, not page-faulted back in
    kernels = Kernels(spec.kernels, dev)  # the rank's attention kernels, built once: layouts, runner share it
    set_upcast(c.bf16_upcast)  # (the GEMM rules are the process's: splash/model/gemm.py)
    set_native(not spec.kernels.enforce_eager)
    if world == 1:
        from splash.attention.local import BatchedLocalLayout

        layout = BatchedLocalLayout(kernels)  # one rank: all decode rows in one batched kernel
    else:
        layout = make_layout(spec.layout_name, kernels)
    net = load_model(spec.model_path, tdtype, rank=grid.rank, world=world,
                     attn_sharded=layout.shards_projections, device=dev, expert_parallel=c.expert_parallel,
                     cfg=cfg)
    weights = weight_bytes(net)
    reserve = reserve_bytes(cfg, tdtype, c.max_num_batched_tokens, c.max_num_seqs)
    pool_weights, keep_free, replicas = weights, 0, 0
    if spec.switching and world > 1:
        from splash.switch.replicas import replica_bytes

        replicas = replica_bytes(net, world)
        if layout.shards_projections:
            keep_free = replicas  # (only the default-sized pool uses it)
        else:
            pool_weights -= replicas  # (only a budgeted pool uses weights)
    slots, state_bytes, snaps = 0, 0, 0
    if cfg.is_hybrid:  # one state slot per request the rank may hold at once, from the same budget
        slots = int(c.num_state_slots or c.max_num_seqs)
        if slots < 1:
            raise ConfigError(f"num_state_slots must be >= 1, got {slots}")
        heads = len(next(la.self_attn for la in net.layers if la.kind == "kda").heads)
        # A live switch into DP/CP holds every head of a slot (Layout.state_placement): budget for it.
        budget_heads = cfg.linear_num_heads if spec.switching else heads
        from splash.kv.snapshots import snapshot_rows

        snaps = snapshot_rows(True, spec.prefix_cache, c.num_state_snapshots, slots)
        state_bytes = (slots + snaps) * StatePool.bytes_per_slot(cfg, tdtype, budget_heads)
    pages = kv_pages(spec, dev, pool_weights, reserve, keep_free=keep_free, state_bytes=state_bytes)
    pool = KVPool.for_model(cfg, pages, spec.page_size, tdtype, dev, spec.kv_format)
    if pool.fmt == "fp8_e4m3":
        from splash.model.loader import kv_scales

        pool.tensor_scale.update(kv_scales(spec.model_path, pool.latent_layers))
    runner = ModelRunner(net, pool, layout, grid.comm, grid.rank, world, kernels=kernels)
    if slots:
        runner.state = StatePool.for_model(cfg, slots + snaps, tdtype, dev, heads=heads)
    runner.switch_comm = getattr(grid, "switch", None)  # layout-switch transfers (splash/switch/)
    # The replicas' pages a DP/CP layout withholds under a budget (splash/switch/replicas.py), ceil.
    withheld = 0
    if c.memory_per_rank is not None and spec.switching and world > 1:
        from splash.switch.replicas import replica_pages

        page_bytes = KVPool.bytes_per_page(cfg, spec.page_size, tdtype, spec.kv_format)
        withheld = replica_pages(net, world, page_bytes)
    facts = RankFacts(pages=pages, weight_bytes=weights, reserve_bytes=reserve, device=str(runner.device),
                      slots=slots, state_bytes=state_bytes, replica_pages=withheld, snapshots=snaps)
    return RankState(runner=runner, facts=facts)
