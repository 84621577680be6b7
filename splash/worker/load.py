"""The one function that builds a rank's share of an engine from the resolved `EngineConfig`.

Rank 0 resolves the user's options (`EngineConfig.resolved`) and sends the config to every rank (a
"load" plan), so worker ranks, including those on other machines, need no flags of their own and
cannot disagree with rank 0. Every rank - rank 0 included - then runs the same `load_rank`, so a rank's
shard, pool and layout are built by identical code everywhere.

Live switching (auto or a schedule): the KV pool makes room for the projection replicas a switch into
DP/CP gathers. Under a budget it is sized as if the projections were head-sharded (the largest pool),
whatever the start layout, and DP/CP withhold the replicas' pages (splash/switch/replicas.py); without
one, the default pool leaves them free (nothing else would check that they fit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from splash.config import EngineConfig
from splash.core.model_config import ConfigError, ModelConfig


@dataclass
class RankState:
    """One rank's built engine share: the runner (model, pool, layout) and facts rank 0 gathers."""

    runner: Any
    pages: int
    weight_bytes: int
    reserve_bytes: int
    slots: int = 0  # KDA state slots (0: the model keeps no per-request state)
    state_bytes: int = 0  # what they take


def rank_device(config: EngineConfig, grid: Any) -> torch.device:
    """The grid's device (CUDA: one per local rank), which must be of the type rank 0 asked for."""
    want = torch.device(config.device or "cpu").type
    if grid.device.type != want:
        raise ConfigError(f"rank {grid.rank} runs on {grid.device.type} but the engine asked for "
                          f"{want}; give every node the same --device")
    return grid.device


def load_rank(config: EngineConfig, grid: Any) -> RankState:
    """Load this rank's model shard for the layout, size and allocate its KV pool, build its runner
    (`config` resolved: `EngineConfig.resolved`)."""
    spec = config
    from splash.attention.registry import make_layout
    from splash.kv.pool import KVPool
    from splash.kv.state import StatePool
    from splash.model import load_model, resolve_dtype, resolve_model_path
    from splash.worker.runner import ModelRunner
    from splash.worker.sizing import kv_pages, reserve_bytes, weight_bytes

    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    dev = rank_device(spec, grid)
    if dev.type == "cpu":
        from splash.worker.host_malloc import tune

        tune()  # activations' memory reused across steps, not page-faulted back in
    path = resolve_model_path(spec.model)
    cfg = ModelConfig.from_hf(path).with_draft(spec.speculative_algorithm == "MTP")
    if spec.world > 1:
        cfg.check_ranks(spec.world)
    if spec.world == 1:
        from splash.attention.local import BatchedLocalLayout

        layout = BatchedLocalLayout(spec.kernels)  # one rank: all decode rows in one batched kernel
    else:
        layout = make_layout(spec.start_layout, spec.kernels)
    tdtype = resolve_dtype(spec.dtype, dev)
    net = load_model(path, tdtype, rank=grid.rank, world=spec.world, attn_sharded=layout.shards_projections,
                     device=dev, expert_parallel=spec.expert_parallel, cfg=cfg)
    max_model_len = int(spec.max_model_len or cfg.max_position_embeddings)
    weights = weight_bytes(net)
    reserve = reserve_bytes(cfg, tdtype, spec.max_num_batched_tokens, spec.max_num_seqs)
    pool_weights, keep_free = weights, 0
    if spec.switching and spec.world > 1:
        from splash.switch.replicas import replica_bytes

        if layout.shards_projections:
            keep_free = replica_bytes(net, spec.world)  # (only the default-sized pool uses it)
        else:
            pool_weights -= replica_bytes(net, spec.world)  # (only a budgeted pool uses weights)
    slots, state_bytes = 0, 0
    if cfg.is_hybrid:  # one state slot per request the rank may hold at once, from the same budget
        slots = int(spec.num_state_slots or spec.max_num_seqs)
        if slots < 1:
            raise ConfigError(f"num_state_slots must be >= 1, got {slots}")
        heads = len(next(la.self_attn for la in net.layers if la.kind == "kda").heads)
        # A live switch into DP/CP holds every head of a slot (Layout.state_placement): budget for it.
        budget_heads = cfg.linear_num_heads if spec.switching else heads
        state_bytes = slots * StatePool.bytes_per_slot(cfg, tdtype, budget_heads)
    pages = kv_pages(cfg, tdtype, spec.page_size, pool_weights, reserve, spec.memory_per_rank,
                     spec.num_kv_pages, spec.max_num_seqs, max_model_len, dev, keep_free=keep_free,
                     state_bytes=state_bytes, kv_cache_dtype=spec.kv_cache_dtype)
    pool = KVPool.for_model(cfg, pages, spec.page_size, tdtype, dev, spec.kv_cache_dtype)
    if pool.fmt == "fp8_e4m3":
        from splash.model.loader import kv_scales

        pool.tensor_scale.update(kv_scales(path, pool.latent_layers))
    runner = ModelRunner(net, pool, layout, grid.comm, grid.rank, spec.world)
    if slots:
        runner.state = StatePool.for_model(cfg, slots, tdtype, dev, heads=heads)
    runner.switch_comm = getattr(grid, "switch", None)  # layout-switch transfers (splash/switch/)
    return RankState(runner=runner, pages=pages, weight_bytes=weights, reserve_bytes=reserve, slots=slots,
                     state_bytes=state_bytes)


def model_name(model: str) -> str:
    return "tiny" if model == "tiny" else os.path.basename(os.path.normpath(os.fspath(model)))
