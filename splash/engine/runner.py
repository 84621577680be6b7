"""Per-rank model runner, and the assembly of a single-rank engine from a model name.

The runner turns a `StepPlan` into the model's `ForwardContext`, runs the forward pass over all
rows and returns logits only for the rows rank 0 samples (the LM head over prefill rows is waste).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from splash.engine import wire
from splash.engine.plan import StepPlan
from splash.engine.sizing import parse_bytes
from splash.engine.tables import RankTables

__all__ = ["GroupRunner", "ModelRunner", "build_engine", "parse_bytes", "STEP_KINDS"]

# Plan kinds other than "forward" that run a step (on every rank), as "module:function" so that every
# process - spawned workers included - resolves them on first use: fn(runner, plan) -> hidden [N, d].
# The live layout switch plugs in here, e.g. STEP_KINDS["switch"] = "splash.switch.step:run_switch_step".
STEP_KINDS: dict[str, str] = {"switch": "splash.engine.switching:run_switch_step"}


def step_kind_fn(kind: str) -> Any:
    """The function that runs a plan of `kind` on a rank (ValueError for an unknown kind)."""
    import importlib

    target = STEP_KINDS.get(kind)
    if target is None:
        raise ValueError(f"no step function for plan kind {kind!r}")
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


class ModelRunner:
    """One rank: weights, its KV pool, its attention layout; runs plans."""

    def __init__(self, model: Any, pool: Any, layout: Any, comm: Any = None, rank: int = 0,
                 world: int = 1) -> None:
        self.model = model
        self.pool = pool
        self.layout = layout
        self.comm = comm
        self.rank = rank
        self.world = world
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.stats: dict[str, Any] = {}
        self.step_rows: OrderedDict[int, int] = OrderedDict()  # step -> rows N (recent steps only)
        self.tables = RankTables()  # this rank's page tables of the live requests (from step messages)
        self._encoder: wire.PlanEncoder | None = None
        self.graphs: Any = None  # CUDA graphs of decode steps (splash/engine/cuda_graph.py), CUDA only
        if self.device.type == "cuda":
            from splash.engine.cuda_graph import for_runner

            self.graphs = for_runner(self)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the plan on this rank; hidden states [N, d] of every row. A decoded step message
        (`plan.delta` set) first updates this rank's tables; a plan built by hand carries its own."""
        cs = getattr(self.comm, "stats", None)
        if cs is not None and cs.step != plan.step:
            cs.begin_step(plan.step)
        self.step_rows[plan.step] = plan.num_rows
        while len(self.step_rows) > 64:
            self.step_rows.popitem(last=False)
        if plan.delta is not None:
            plan.delta.apply(self.tables, self.rank)
        if plan.kind != "forward":
            return step_kind_fn(plan.kind)(self, plan)
        ctx = self.context(plan, self.layout)
        ids = self.input_ids(plan)
        if self.graphs is not None:
            out = self.graphs.run(ids, ctx)
            if out is not None:
                return out
        return self.model(ids, ctx.positions, ctx)

    def context(self, plan: StepPlan, layout: Any) -> Any:
        """The step's ForwardContext under `layout`, from this rank's tables (or the plan's own)."""
        from splash.model.context import ForwardContext

        return ForwardContext.build(plan.seqs, kv=self.pool, layout=layout, comm=self.comm, rank=self.rank,
                                    world=self.world, device=self.device, stats=self.stats,
                                    tables=self.tables if plan.delta is not None else None)

    def input_ids(self, plan: StepPlan) -> torch.Tensor:
        from splash.model.context import to_device

        ids = plan.input_ids
        if isinstance(ids, np.ndarray):
            return to_device(torch.from_numpy(ids.astype(np.int64)), self.device)
        return to_device(torch.tensor(ids, dtype=torch.long), self.device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [n_sample, V] for the plan's sample rows (rank 0's view). A plan as the scheduler made
        it goes through the step message first, as on T ranks (so T = 1 runs the same path)."""
        if plan.delta is None and plan.kind in ("forward", *STEP_KINDS):
            plan = wire.decode(self.encoder.encode(plan))
        hidden = self.forward(plan)
        rows = plan.sample_rows()
        if not rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size)
        from splash.model.context import to_device

        idx = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))

    @property
    def encoder(self) -> wire.PlanEncoder:
        """Rank 0's step-message encoder when this runner is the engine's (T = 1)."""
        if self._encoder is None:
            self._encoder = wire.PlanEncoder(self.world)
        return self._encoder

    def decode_plan_bytes_p50(self) -> int | None:
        return self._encoder.decode_bytes_p50() if self._encoder is not None else None

    def rank_tables(self) -> list[dict[int, list[int]]]:
        """This rank's page tables {req_id: local pages} (one rank: the only one)."""
        return [self.tables.snapshot()]

    def comm_stats(self) -> list[dict[str, Any]]:
        """Collective byte counters of every rank (here: the one rank)."""
        from splash.engine.worker import WorkerState, stats_reply

        if self.comm is None:
            return []
        return [stats_reply(WorkerState(_OneRank(self.comm)))]

    def shutdown(self) -> None:
        """Nothing to stop on one rank (the GroupRunner stops the others)."""


class _OneRank:
    """The bits of a RankGrid `stats_reply` reads, for a lone runner."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.rank = comm, getattr(comm, "rank", 0)


class GroupRunner:
    """Rank 0's runner on T ranks: each plan goes to every rank, then rank 0 runs its own share.

    The step is SPMD: the workers run the same forward on their shard (splash/engine/worker.py); only
    rank 0 computes logits, since the LM head is replicated. Any failure marks the group failed (see
    RankGroup.guarded) and every later step raises at once.
    """

    def __init__(self, group: Any, local: ModelRunner, owns_group: bool = True) -> None:
        self.group = group
        self.local = local
        self.owns_group = owns_group
        self.device = local.device
        self.encoder = wire.PlanEncoder(group.world)

    @property
    def step_rows(self) -> OrderedDict[int, int]:
        return self.local.step_rows

    def failure(self) -> BaseException | None:
        """Why the rank group can run no more steps (None while it can): it failed, was closed, or a
        local worker has exited, even while idle (that marks the group failed)."""
        from splash.dist.launch import WorkerError
        from splash.engine.group import GroupFailed

        try:
            self.group.check()
        except (GroupFailed, WorkerError) as e:
            return self.group.error or e
        return None

    def execute(self, plan: StepPlan) -> torch.Tensor:
        cs = self.local.comm.stats
        cs.begin_step(plan.step)  # the plan's own broadcast counts towards its step
        return self.group.guarded(self._step, plan)

    def _step(self, plan: StepPlan) -> torch.Tensor:
        msg = self.encoder.encode(plan)
        self.group.send(msg)
        return self.local.execute(wire.decode(msg))

    def decode_plan_bytes_p50(self) -> int | None:
        """Median bytes of the step message over forward steps with no prefill rows."""
        return self.encoder.decode_bytes_p50()

    def rank_tables(self) -> list[dict[int, list[int]]]:
        """Every rank's own page tables {req_id: local pages} (tests and debugging; one control message)."""
        return self.group.gather_tables()

    def comm_stats(self) -> list[dict[str, Any]]:
        """Every rank's collective byte counters (one control message; call it when needed)."""
        return self.group.gather_stats()

    def shutdown(self) -> None:
        """Stop the workers (or, on a shared group, just drop this engine's shards)."""
        if self.owns_group:
            self.group.close()
        elif self.group.owner is None or self.group.owner is self:
            self.group.unload()


def build_engine(model: str = "tiny", dtype: str | torch.dtype | None = None, max_num_seqs: int = 64,
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
                 attention_form: str | None = None) -> Any:
    """Load `model` ('tiny' or a checkpoint directory) on T ranks and build the LLMEngine (rank 0).

    T = 1 runs in this process. T > 1 starts the rank group (rank 0 here, this node's other ranks as
    spawned processes, other nodes via `--nnodes/--node-rank/--dist-init-addr` or torchrun), or loads
    onto `rank_group` (a RankGroup that outlives the engine, e.g. a benchmark reusing its ranks).
    `collective_timeout_s` bounds every data-plane collective (a hung rank fails the engine then).
    `layout`: "tp" | "dp" | "cp" | "dop", or "auto" (the default when T > 1: the layout policy switches
    live, see splash/engine/switching.py); `switch_schedule` "STEP:LAYOUT,..." forces switches;
    `switch_mode` "overlapped" | "blocking"; `theta` a calibrated theta JSON for "auto".
    `long_prefill_token_threshold` caps one prompt's chunk per step (0: only the step budget does);
    `attention_form` "auto" | "absorbed" | "mha" (splash/attention/mha.py; auto picks per chunk; None:
    SPLASH_ATTN_FORM, else auto).
    """
    from splash.config import ConfigError, ModelConfig
    from splash.dist.groups import DEFAULT_TIMEOUT_S, local_grid, parse_device
    from splash.dist.launch import resolve_launch
    from splash.engine.group import RankGroup
    from splash.engine.llm_engine import LLMEngine
    from splash.engine.plan import LAYOUTS
    from splash.engine.scheduler import SchedulerConfig
    from splash.engine.spec import EngineSpec, load_rank, model_name
    from splash.kv.allocator import KVAllocator
    from splash.model import resolve_model_path

    if layout is not None and layout not in (*LAYOUTS, "auto"):
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {page_size}")
    from splash.attention.mha import FORMS, form

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
    dev = parse_device(device)
    max_model_len = int(max_model_len or cfg.max_position_embeddings)
    if max_model_len > cfg.max_position_embeddings:  # (vLLM refuses; benchmarks here may want it)
        import logging

        logging.getLogger("splash.engine").warning(
            "max_model_len %d exceeds the model's %d positions (max_position_embeddings): positions past "
            "it are extrapolated and the model was not trained on them", max_model_len,
            cfg.max_position_embeddings)
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(512, max_num_seqs)
    try:  # refused before any rank starts
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len,
                                long_prefill_token_threshold=long_prefill_token_threshold)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if memory_per_rank is not None:
        parse_bytes(memory_per_rank)  # a typo fails here, before any rank starts
    from splash.engine.switching import attach_switching, resolve_layout

    layout, auto, schedule = resolve_layout(layout, world, switch_schedule)
    spec = EngineSpec(model="tiny" if model == "tiny" else os.path.abspath(path),
                      dtype=None if dtype is None else str(dtype).removeprefix("torch."), layout=layout,
                      world=world, page_size=page_size, memory_per_rank=memory_per_rank,
                      num_kv_pages=num_kv_pages, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                      device_type=dev.type, seed=seed, expert_parallel=expert_parallel,
                      switching=auto or bool(schedule), attention_form=attention_form)
    if world == 1:
        state = load_rank(spec, local_grid(dev))
        runner: Any = state.runner
        facts = [{"pages": state.pages, "weight_bytes": state.weight_bytes,
                  "reserve_bytes": state.reserve_bytes}]
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
    tok = _load_tokenizer(path)
    eos = set(cfg.eos_token_ids)
    tok_eos = getattr(tok, "eos_token_id", None)
    if isinstance(tok_eos, int):
        eos.add(tok_eos)
    name = model_name(model)
    dt = str(net.dtype).removeprefix("torch.")
    info = {"model": name, "dtype": dt, "device": str(runner.device), "kv_dtype": dt,
            "nnodes": launch.nnodes, "weight_bytes_per_rank": [f["weight_bytes"] for f in facts],
            "kv_reserve_bytes": facts[0]["reserve_bytes"]}
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
    from splash.tokenizer import load_tokenizer

    return load_tokenizer(path)
