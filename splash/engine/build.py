"""Building an engine from a model name: resolve the user's options and the checkpoint once into a
`RuntimeSpec` (splash/engine/resolve.py), start (or join) the rank group, load every rank's share from
the spec, and assemble rank 0's LLMEngine, complete (it builds its scheduler and switch controller from
the spec; nothing is set on it afterwards).

`build_engine` is what `LLM`, `AsyncEngine.from_args`, the CLI and the benchmarks call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from splash.config import EngineConfig
from splash.core.model_config import ConfigError
from splash.distributed.groups import DEFAULT_TIMEOUT_S, local_grid
from splash.distributed.launch import resolve_launch
from splash.engine.group import RankGroup
from splash.engine.group_runner import GroupRunner
from splash.engine.llm_engine import LLMEngine
from splash.engine.resolve import resolve_engine
from splash.kv.allocator import KVAllocator
from splash.runtime_spec import RuntimeSpec
from splash.worker.load import RankFacts, load_rank

log = logging.getLogger("splash.engine")


def build_engine(config: EngineConfig | str | None = None, /, *, rank_group: Any = None,
                 **options: Any) -> LLMEngine:
    """Load the configured model on T ranks and build the LLMEngine (rank 0).

    `config` is the whole set of options (splash/config.py); keywords instead make one (a string first:
    the model)
    (`EngineConfig.from_kwargs`: an unknown key is refused naming the nearest valid one). T = 1 runs in
    this process. T > 1 starts the rank group (rank 0 here, this node's other ranks as spawned processes,
    other nodes via `--nnodes/--node-rank/--dist-init-addr` or torchrun), or loads onto `rank_group` (a
    RankGroup that outlives the engine, e.g. a benchmark reusing its ranks). Every rank builds its share
    from the `RuntimeSpec` rank 0 resolved (splash/engine/resolve.py), sent once.
    """
    if isinstance(config, str):  # build_engine("tiny", dtype=...): the model, then keywords
        config = EngineConfig.from_kwargs(model=config, **options)
    elif config is None:
        config = EngineConfig.from_kwargs(**options)
    elif options:
        raise TypeError(f"build_engine takes a config or keywords, not both (got {', '.join(options)})")
    if rank_group is not None:
        launch = rank_group.launch
        if config.tp is not None and config.tp != launch.world:
            raise ConfigError(f"tp={config.tp} but the rank group given has {launch.world} ranks")
    else:
        try:
            launch = resolve_launch(config.tp, config.nnodes, config.node_rank, config.dist_init_addr)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    world = launch.world
    if not launch.has_leader:
        raise ConfigError(f"node {launch.node_rank} runs worker ranks {list(launch.ranks)} only; start it "
                          "with `splash generate|serve ... --node-rank R` (or engine.group.run_worker_node)")
    spec, tok = resolve_engine(config, world)
    rc = spec.config
    if world == 1:
        state = load_rank(spec, local_grid(torch.device(rc.device)))
        runner: Any = state.runner
        facts = [state.facts]
    else:
        group = rank_group or RankGroup.join(launch, device=spec.device, threads=rc.threads,
                                             timeout_s=rc.collective_timeout_s or DEFAULT_TIMEOUT_S,
                                             cpu_bind=rc.cpu_bind, cpu_comm=rc.cpu_comm)
        try:
            facts = group.load(spec)
        except BaseException:
            if rank_group is None:
                group.close()
            raise
        runner = GroupRunner(group, group.state.runner, owns_group=rank_group is None)
        group.owner = runner
    try:
        return _assemble(spec, runner, facts, tok, launch.nnodes)
    except BaseException:
        stop = getattr(runner, "shutdown", None)
        if stop is not None:
            stop()
        raise


def _assemble(spec: RuntimeSpec, runner: Any, facts: list[RankFacts], tok: Any, nnodes: int) -> LLMEngine:
    """Rank 0's engine over loaded ranks: the allocators from the ranks' pages, the tokenizer's chat
    template, the static facts `stats()` reports; the engine builds the rest from the spec."""
    from splash.core.stores import store_row_bytes, token_stores

    rc, cfg, fmt = spec.config, spec.model, spec.kv_format
    alloc = KVAllocator([f.pages for f in facts], spec.page_size, world=spec.world, layout=spec.start_layout)
    if spec.prefix_cache:
        alloc.enable_prefix_cache()
    if facts[0].slots:  # KDA hybrids: a state slot per admitted request (splash/kv/slots.py)
        from splash.kv.slots import SlotAllocator

        alloc.slots = SlotAllocator(facts[0].slots)
        if alloc.cache is not None:  # the prefix cache's KDA state rows, after the slots (kv/snapshots.py)
            from splash.kv.snapshots import SnapshotPool

            alloc.cache.snaps = SnapshotPool(facts[0].slots, facts[0].snapshots)
    info = {"model": spec.model_name, "model_type": cfg.model_type,
            "dtype": str(spec.dtype).removeprefix("torch."), "device": str(runner.device),
            "kv_dtype": fmt, "kv_cache_dtype": rc.kv_cache_dtype or "auto",
            # every per-token store a page holds (the latent; a DSA model's indexer keys), bytes per token
            # in the pool's element format: the core's rule (`store_row_bytes`), the pool's rows
            "kv_bytes_per_token": {s.name: store_row_bytes(cfg, s, fmt) * len(s.layers)
                                   for s in token_stores(cfg)},
            "nnodes": nnodes, "weight_bytes_per_rank": [f.weight_bytes for f in facts],
            "kv_reserve_bytes": facts[0].reserve_bytes,
            "state_bytes_per_rank": [f.state_bytes for f in facts]}
    if rc.chat_template is not None and tok is not None:  # --chat-template: the server's template
        from splash.chat.template import resolve_chat_template

        tok.set_chat_template(resolve_chat_template(rc.chat_template))
    if tok is not None and getattr(tok, "chat_format_warning", None):  # a real model with no chat format
        log.warning("%s", tok.chat_format_warning)
    # Replica pages per rank (a budgeted, switching pool): rank 0's count on every rank, as planned.
    weight_pages = [facts[0].replica_pages] * spec.world if spec.world > 1 else None
    return LLMEngine(spec, runner, alloc, tok, info=info, weight_pages=weight_pages)
