"""Building an engine from a model name: resolve the user's options, start (or join) the rank group,
load every rank's share, and assemble rank 0's LLMEngine (scheduler, allocators, switch controller).

`build_engine` is what `LLM`, `AsyncEngine.from_args`, the CLI and the benchmarks call.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from splash.attention.mha import FORMS, form
from splash.core.config import ConfigError, ModelConfig
from splash.core.stores import stores
from splash.dist.groups import DEFAULT_TIMEOUT_S, local_grid, parse_device
from splash.dist.launch import resolve_launch
from splash.engine.group import RankGroup
from splash.engine.group_runner import GroupRunner
from splash.engine.llm_engine import LLMEngine
from splash.engine.scheduler import SchedulerConfig, default_max_num_seqs, default_token_budget
from splash.kv.allocator import KVAllocator
from splash.model import resolve_model_path
from splash.step.plan import LAYOUTS
from splash.switch.controller import attach_switching
from splash.switch.options import resolve_layout
from splash.worker.load import EngineSpec, load_rank, model_name
from splash.worker.sizing import parse_bytes

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


def build_engine(model: str = "tiny", dtype: str | torch.dtype | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 memory_per_rank: int | str | None = None, page_size: int = 16,
                 num_kv_pages: int | None = None, device: str | torch.device | None = None,
                 layout: str | None = None, ranks: int | None = None, tp: int | None = None,
                 seed: int | None = None, *, nnodes: int = 1, node_rank: int = 0,
                 dist_init_addr: str | None = None, rank_group: Any = None,
                 collective_timeout_s: float | None = None, threads: int | None = None,
                 expert_parallel: str = "auto", switch_schedule: Any = None,
                 switch_mode: str = "overlapped", theta: str | None = None, switch_margin: float = 0.05,
                 min_dwell_steps: int = 8, long_prefill_token_threshold: int = 0,
                 attention_form: str | None = None, serving: bool = False,
                 enable_prefix_caching: bool | None = None, num_state_slots: int | None = None) -> Any:
    """Load `model` ('tiny' or a checkpoint directory) on T ranks and build the LLMEngine (rank 0).

    T = 1 runs in this process. T > 1 starts the rank group (rank 0 here, this node's other ranks as
    spawned processes, other nodes via `--nnodes/--node-rank/--dist-init-addr` or torchrun), or loads
    onto `rank_group` (a RankGroup that outlives the engine, e.g. a benchmark reusing its ranks).
    `collective_timeout_s` bounds every data-plane collective (a hung rank fails the engine then).
    `layout`: "tp" | "dp" | "cp" | "dop", or "auto" (the default when T > 1: the layout policy switches
    live, see splash/switch/controller.py); `switch_schedule` "STEP:LAYOUT,..." forces switches;
    `switch_mode` "overlapped" | "blocking"; `theta` a calibrated theta JSON for "auto".
    `long_prefill_token_threshold` caps one prompt's chunk per step (0: only the step budget does);
    `attention_form` "auto" | "absorbed" | "mha" (splash/attention/mha.py; auto picks per chunk; None:
    SPLASH_ATTN_FORM, else auto). `enable_prefix_caching`: share full prompt pages by content
    (splash/kv/prefix.py); None (the default) turns it on, as both peers do, except for models whose
    requests keep per-request state a shared prefix cannot carry (KDA hybrids: `prefix_cache_default`).
    `num_state_slots` (KDA hybrids): requests whose recurrent state a rank holds at once (default
    max_num_seqs); the scheduler admits no more, and the slots come out of the memory budget.
    """
    if layout is not None and layout not in (*LAYOUTS, "auto"):
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {page_size}")
    attention_form = form() if attention_form is None else str(attention_form).strip().lower()
    if attention_form not in FORMS:
        raise ConfigError(f"unknown attention form {attention_form!r}; choose one of {', '.join(FORMS)}")
    asked = ranks if ranks is not None else tp
    if rank_group is not None:
        launch = rank_group.launch
        if asked is not None and int(asked) != launch.world:
            raise ConfigError(f"tp={asked} but the rank group given has {launch.world} ranks")
    else:
        try:
            launch = resolve_launch(None if asked is None else int(asked), nnodes, node_rank, dist_init_addr)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    world = launch.world
    if not launch.has_leader:
        raise ConfigError(f"node {launch.node_rank} runs worker ranks {list(launch.ranks)} only; start it "
                          "with `splash generate|serve ... --node-rank R` (or engine.group.run_worker_node)")
    path = resolve_model_path(model)
    cfg = ModelConfig.from_hf(path)
    if world > 1:
        cfg.check_ranks(world)  # refuse before starting any process
    if num_state_slots is not None and (not isinstance(num_state_slots, int) or num_state_slots < 1):
        raise ConfigError(f"num_state_slots must be a positive integer, got {num_state_slots!r}")
    dev = parse_device(device)
    max_model_len = int(max_model_len or cfg.max_position_embeddings)
    if max_model_len > cfg.max_position_embeddings:  # (vLLM refuses; benchmarks here may want it)
        log.warning(
            "max_model_len %d exceeds the model's %d positions (max_position_embeddings): positions past "
            "it are extrapolated and the model was not trained on them", max_model_len,
            cfg.max_position_embeddings)
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_num_seqs is None:
        max_num_seqs = default_max_num_seqs(world, serving)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_token_budget(world, max_num_seqs, serving)
    try:  # refused before any rank starts
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len,
                                long_prefill_token_threshold=long_prefill_token_threshold)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if memory_per_rank is not None:
        parse_bytes(memory_per_rank)  # a typo fails here, before any rank starts
    layout, auto, schedule = resolve_layout(layout, world, switch_schedule)
    spec = EngineSpec(model="tiny" if model == "tiny" else os.path.abspath(path),
                      dtype=None if dtype is None else str(dtype).removeprefix("torch."), layout=layout,
                      world=world, page_size=page_size, memory_per_rank=memory_per_rank,
                      num_kv_pages=num_kv_pages, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                      device_type=dev.type, seed=seed, expert_parallel=expert_parallel,
                      switching=auto or bool(schedule), attention_form=attention_form,
                      num_state_slots=num_state_slots)
    if world == 1:
        state = load_rank(spec, local_grid(dev))
        runner: Any = state.runner
        facts = [{"pages": state.pages, "weight_bytes": state.weight_bytes,
                  "reserve_bytes": state.reserve_bytes, "slots": state.slots,
                  "state_bytes": state.state_bytes}]
    else:
        group = rank_group or RankGroup.join(launch, device=dev.type, threads=threads,
                                             timeout_s=collective_timeout_s or DEFAULT_TIMEOUT_S)
        try:
            facts = group.load(spec)
        except BaseException:
            if rank_group is None:
                group.close()
            raise
        runner = GroupRunner(group, group.state.runner, owns_group=rank_group is None)
        group.owner = runner
    net = runner.model if world == 1 else runner.local.model
    alloc = KVAllocator([f["pages"] for f in facts], page_size, world=world, layout=layout)
    if prefix_cache_default(cfg, enable_prefix_caching):
        alloc.enable_prefix_cache()
    if facts[0].get("slots"):  # KDA hybrids: a state slot per admitted request (splash/kv/state.py)
        from splash.kv.state import SlotAllocator

        alloc.slots = SlotAllocator(int(facts[0]["slots"]))
    tok = _load_tokenizer(path)
    eos = set(cfg.eos_token_ids)
    tok_eos = getattr(tok, "eos_token_id", None)
    if isinstance(tok_eos, int):
        eos.add(tok_eos)
    name = model_name(model)
    dt = str(net.dtype).removeprefix("torch.")
    from splash.core.stores import token_stores

    elem = net.embed.element_size()
    info = {"model": name, "dtype": dt, "device": str(runner.device), "kv_dtype": dt,
            # every per-token store a page holds (the latent; a DSA model's indexer keys), bytes per token
            "kv_bytes_per_token": {s.name: s.values_per_token * elem for s in token_stores(cfg)},
            "nnodes": launch.nnodes, "weight_bytes_per_rank": [f["weight_bytes"] for f in facts],
            "kv_reserve_bytes": facts[0]["reserve_bytes"],
            "state_bytes_per_rank": [f.get("state_bytes", 0) for f in facts]}
    engine = LLMEngine(runner, alloc, sched, tokenizer=tok, eos_token_ids=sorted(eos),
                       vocab_size=cfg.vocab_size, model_name=name, info=info)
    engine.checkpoint_path = os.path.abspath(path)  # what a memory resume without backup re-reads
    if world > 1:
        try:
            attach_switching(engine, cfg, net, auto=auto, schedule=schedule, mode=switch_mode, theta=theta,
                             margin=switch_margin, min_dwell=min_dwell_steps,
                             budget=memory_per_rank is not None, device=dev.type)
        except BaseException:
            engine.shutdown()
            raise
    return engine


def _load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (then only token ids work)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from splash.tokenizer import load_tokenizer  # (the `tokenizers` package, only when one is shipped)

    return load_tokenizer(path)
