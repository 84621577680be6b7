"""Building an engine from a model name: resolve the user's options, start (or join) the rank group,
load every rank's share, and assemble rank 0's LLMEngine (scheduler, allocators, switch controller).

`build_engine` is what `LLM`, `AsyncEngine.from_args`, the CLI and the benchmarks call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from splash.config import EngineConfig
from splash.core.model_config import ConfigError, ModelConfig
from splash.core.stores import stores
from splash.distributed.groups import DEFAULT_TIMEOUT_S, local_grid, parse_device
from splash.distributed.launch import resolve_launch
from splash.engine.group import RankGroup
from splash.engine.group_runner import GroupRunner
from splash.engine.llm_engine import LLMEngine
from splash.engine.scheduler import SchedulerConfig
from splash.kv.allocator import KVAllocator
from splash.model import resolve_model_path
from splash.model.tiny import BUILTIN_MODELS
from splash.switch.controller import attach_switching
from splash.worker.load import load_rank, model_name

log = logging.getLogger("splash.engine")


def prefix_cache_default(cfg: ModelConfig, asked: bool | None) -> bool:
    """Whether the engine runs the prefix cache: on unless turned off, as in vLLM and SGLang. A model
    whose requests keep per-request state (the recurrent state of KDA layers) bypasses it: a shared
    prefix's pages would not give a request that state; asking for it explicitly is an error."""
    per_request = [s.name for s in stores(cfg) if s.per == "request"]
    if per_request:
        if asked:
            raise ConfigError(f"{cfg.name}: the prefix cache shares KV pages, but this model's requests "
                              f"also keep per-request state ({', '.join(per_request)}: KDA's recurrent "
                              "state) that a cached prefix cannot provide; drop --enable-prefix-caching")
        if asked is None:
            log.info("%s: prefix cache off: KDA layers keep a per-request recurrent state", cfg.name)
        return False
    return True if asked is None else bool(asked)


def build_engine(config: EngineConfig | str | None = None, /, *, rank_group: Any = None,
                 **options: Any) -> LLMEngine:
    """Load the configured model on T ranks and build the LLMEngine (rank 0).

    `config` is the whole set of options (splash/config.py); keywords instead make one (a string first:
    the model)
    (`EngineConfig.from_kwargs`: an unknown key is refused naming the nearest valid one). T = 1 runs in
    this process. T > 1 starts the rank group (rank 0 here, this node's other ranks as spawned processes,
    other nodes via `--nnodes/--node-rank/--dist-init-addr` or torchrun), or loads onto `rank_group` (a
    RankGroup that outlives the engine, e.g. a benchmark reusing its ranks). Every rank builds its share
    from the resolved config (`EngineConfig.resolved`), sent once.
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
    path = resolve_model_path(config.model)
    cfg = ModelConfig.from_hf(path).with_draft(config.speculative_algorithm == "MTP")
    if world > 1:
        cfg.check_ranks(world)  # refuse before starting any process
    dev = parse_device(config.device)
    rc = config.resolved(world, cfg.max_position_embeddings)
    model = config.model if config.model in BUILTIN_MODELS else os.path.abspath(path)
    rc = dataclasses.replace(rc, model=model, device=dev.type if config.device is None else config.device)
    if rc.max_model_len > cfg.max_position_embeddings:  # (vLLM refuses; benchmarks here may want it)
        log.warning(
            "max_model_len %d exceeds the model's %d positions (max_position_embeddings): positions past "
            "it are extrapolated and the model was not trained on them", rc.max_model_len,
            cfg.max_position_embeddings)
    sched = SchedulerConfig(max_num_seqs=rc.max_num_seqs, max_num_batched_tokens=rc.max_num_batched_tokens,
                            max_model_len=rc.max_model_len,
                            long_prefill_token_threshold=rc.long_prefill_token_threshold)
    if world == 1:
        state = load_rank(rc, local_grid(dev))
        runner: Any = state.runner
        facts = [{"pages": state.pages, "weight_bytes": state.weight_bytes,
                  "reserve_bytes": state.reserve_bytes, "slots": state.slots,
                  "state_bytes": state.state_bytes}]
    else:
        group = rank_group or RankGroup.join(launch, device=dev.type, threads=rc.threads,
                                             timeout_s=rc.collective_timeout_s or DEFAULT_TIMEOUT_S)
        try:
            facts = group.load(rc)
        except BaseException:
            if rank_group is None:
                group.close()
            raise
        runner = GroupRunner(group, group.state.runner, owns_group=rank_group is None)
        group.owner = runner
    net = runner.model if world == 1 else runner.local.model
    alloc = KVAllocator([f["pages"] for f in facts], rc.page_size, world=world, layout=rc.start_layout)
    if prefix_cache_default(cfg, rc.enable_prefix_caching):
        alloc.enable_prefix_cache()
    if facts[0].get("slots"):  # KDA hybrids: a state slot per admitted request (splash/kv/slots.py)
        from splash.kv.slots import SlotAllocator

        alloc.slots = SlotAllocator(int(facts[0]["slots"]))
    tok = _load_tokenizer(path)
    eos = set(cfg.eos_token_ids)
    tok_eos = getattr(tok, "eos_token_id", None)
    if isinstance(tok_eos, int):
        eos.add(tok_eos)
    name = model_name(config.model)
    dt = str(net.dtype).removeprefix("torch.")
    from splash.core.stores import store_row_bytes, token_stores
    from splash.kv.pool import format_of

    fmt = format_of(rc.kv_cache_dtype, net.dtype)
    info = {"model": name, "model_type": cfg.model_type, "dtype": dt, "device": str(runner.device),
            "kv_dtype": fmt, "kv_cache_dtype": rc.kv_cache_dtype or "auto",
            # every per-token store a page holds (the latent; a DSA model's indexer keys), bytes per token
            # in the pool's element format: the core's rule (`store_row_bytes`), the pool's rows
            "kv_bytes_per_token": {s.name: store_row_bytes(cfg, s, fmt) * len(s.layers)
                                   for s in token_stores(cfg)},
            "nnodes": launch.nnodes, "weight_bytes_per_rank": [f["weight_bytes"] for f in facts],
            "kv_reserve_bytes": facts[0]["reserve_bytes"],
            "state_bytes_per_rank": [f.get("state_bytes", 0) for f in facts]}
    engine = LLMEngine(runner, alloc, sched, tokenizer=tok, eos_token_ids=sorted(eos),
                       vocab_size=cfg.vocab_size, model_name=name, info=info, config=rc)
    engine.checkpoint_path = os.path.abspath(path)  # what a memory resume without backup re-reads
    engine.generation_defaults = generation_defaults(rc.generation_config, path)
    if rc.chat_template is not None and tok is not None:  # --chat-template: the server's template
        from splash.chat.template import resolve_chat_template

        tok.set_chat_template(resolve_chat_template(rc.chat_template))
    if tok is not None and getattr(tok, "chat_format_warning", None):  # a real model with no chat format
        log.warning("%s", tok.chat_format_warning)
    if engine.scheduler.proposer is not None and rc.speculative_policy == "auto":
        from splash.engine.spec import attach_depth_policy

        attach_depth_policy(engine, cfg, net.dtype, world)
    if world > 1:
        try:
            attach_switching(engine, cfg, net, rc)
        except BaseException:
            engine.shutdown()
            raise
    return engine


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(choice: str, path: str) -> dict[str, Any]:
    """The sampling defaults of a checkpoint's generation_config.json (vLLM's `--generation-config`):
    "auto" reads the model's, "vllm" none, a folder that one's; only the keys both peers apply."""
    if choice == "vllm":
        return {}
    folder = path if choice == "auto" else choice
    file = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(file):
        if choice != "auto":
            raise ConfigError(f"--generation-config {choice!r}: no generation_config.json there; give a "
                              f"folder holding one, or auto / vllm")
        return {}
    import json

    with open(file, encoding="utf-8") as f:
        d = json.load(f)
    return {k: d[k] for k in GENERATION_KEYS
            if isinstance(d.get(k), (int, float)) and not isinstance(d[k], bool)}


def _load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (then only token ids work)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from splash.tokenizer import load_tokenizer  # (the `tokenizers` package, only when one is shipped)

    return load_tokenizer(path)
