"""What every rank needs to build its share of an engine, and the one function that builds it.

Rank 0 resolves the user's options into an `EngineSpec` and sends it to every rank (a "load" plan),
so worker ranks, including those on other machines, need no flags of their own and cannot disagree
with rank 0. Every rank - rank 0 included - then runs the same `load_rank`, so a rank's shard, pool
and layout are built by identical code everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from splash.core.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class EngineSpec:
    """The resolved, picklable engine options a rank builds from."""

    model: str                   # checkpoint directory or "tiny" (resolved on each machine)
    dtype: str | None            # None: per device (float32 on CPU, bfloat16 on CUDA)
    layout: str                  # "tp" | "dp" | "cp" | "dop" (T = 1 runs the local layout whatever it says)
    world: int
    page_size: int = 16
    memory_per_rank: int | str | None = None
    num_kv_pages: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    device_type: str = "cpu"     # "cpu" | "cuda": each rank takes its own device of that type
    seed: int | None = None
    expert_parallel: str = "auto"
    # Live switching (auto or a schedule): the KV pool makes room for the projection replicas a switch
    # into DP/CP gathers. Under a budget it is sized as if the projections were head-sharded (the
    # largest pool), whatever the start layout, and DP/CP withhold the replicas' pages (see
    # splash/switch/replicas.py); without one, the default pool leaves them free (nothing else would
    # check that they fit: no budget, no Eq 5/6 pages).
    switching: bool = False
    attention_form: str = "auto"  # "auto" | "absorbed" | "mha": chunk forms (splash/attention/mha.py)
    # KDA hybrids: requests whose state a rank holds at once (splash/kv/state.py); None: max_num_seqs.
    # The slots come out of the same memory budget as the KV pages (sizing.kv_pages).
    num_state_slots: int | None = None


@dataclass
class RankState:
    """One rank's built engine share: the runner (model, pool, layout) and facts rank 0 gathers."""

    runner: Any
    pages: int
    weight_bytes: int
    reserve_bytes: int
    slots: int = 0  # KDA state slots (0: the model keeps no per-request state)
    state_bytes: int = 0  # what they take


def rank_device(spec: EngineSpec, grid: Any) -> torch.device:
    """The grid's device (CUDA: one per local rank), which must be of the type rank 0 asked for."""
    if grid.device.type != spec.device_type:
        raise ConfigError(f"rank {grid.rank} runs on {grid.device.type} but the engine asked for "
                          f"{spec.device_type}; give every node the same --device")
    return grid.device


def load_rank(spec: EngineSpec, grid: Any) -> RankState:
    """Load this rank's model shard for the layout, size and allocate its KV pool, build its runner."""
    from splash.attention.registry import make_layout
    from splash.kv.pool import KVPool
    from splash.kv.state import StatePool
    from splash.model import load_model, resolve_dtype, resolve_model_path
    from splash.worker.runner import ModelRunner
    from splash.worker.sizing import kv_pages, reserve_bytes, weight_bytes

    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    from splash.attention.mha import set_form

    set_form(spec.attention_form)
    dev = rank_device(spec, grid)
    if dev.type == "cpu":
        from splash.worker.host_malloc import tune

        tune()  # activations' memory reused across steps, not page-faulted back in
    path = resolve_model_path(spec.model)
    cfg = ModelConfig.from_hf(path)
    if spec.world > 1:
        cfg.check_ranks(spec.world)
    if spec.world == 1:
        from splash.attention.local import BatchedLocalLayout

        layout = BatchedLocalLayout()  # one rank: all decode rows attended in one batched kernel
    else:
        layout = make_layout(spec.layout)
    tdtype = resolve_dtype(spec.dtype, dev)
    net = load_model(path, tdtype, rank=grid.rank, world=spec.world, attn_sharded=layout.shards_projections,
                     device=dev, expert_parallel=spec.expert_parallel)
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
                     state_bytes=state_bytes)
    pool = KVPool.for_model(cfg, pages, spec.page_size, tdtype, dev)
    runner = ModelRunner(net, pool, layout, grid.comm, grid.rank, spec.world)
    if slots:
        runner.state = StatePool.for_model(cfg, slots, tdtype, dev, heads=heads)
    runner.switch_comm = getattr(grid, "switch", None)  # layout-switch transfers (splash/switch/)
    return RankState(runner=runner, pages=pages, weight_bytes=weights, reserve_bytes=reserve, slots=slots,
                     state_bytes=state_bytes)


def model_name(model: str) -> str:
    return "tiny" if model == "tiny" else os.path.basename(os.path.normpath(os.fspath(model)))
