"""Per-rank model runner: a step plan in, logits of the sampled rows out.

The runner turns a `StepPlan` into the model's `ForwardContext`, runs the forward pass over all
rows and returns logits only for the rows rank 0 samples (the LM head over prefill rows is waste). A
"switch" plan is a forward step in which the layout switches (splash/switch/step.py). Rank 0's runner
on T ranks is splash/engine/group_runner.py; an engine is built by splash/engine/build.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from splash.step import wire
from splash.step.plan import STEP_KINDS, RowLogprobs, StepPlan
from splash.step.tables import RankTables
from splash.switch.step import run_switch_step

__all__ = ["ModelRunner", "decoded"]

ROW_CHUNK = 256  # prompt-logprob rows whose logits exist at once (bounds [rows, V] on long prompts)


def decoded(plan: StepPlan, msg: Any) -> StepPlan:
    """The step message as every rank decodes it, with what only rank 0 needs kept (row_logprobs,
    num_sample)."""
    out = wire.decode(msg)
    out.row_logprobs = plan.row_logprobs
    out.num_sample = plan.num_sample
    return out


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
        self.state: Any = None  # a KDA hybrid's StatePool (splash/kv/state.py): its requests' slots
        self._encoder: wire.PlanEncoder | None = None
        self.graphs: Any = None  # CUDA graphs of decode steps (splash/worker/cuda_graph.py), CUDA only
        # (CUDA graphs skip KDA hybrids for now: for_runner returns None for them)
        if self.device.type == "cuda":
            from splash.worker.cuda_graph import for_runner

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
        if plan.kind == "switch":
            return run_switch_step(self, plan)
        if plan.kind != "forward":
            raise ValueError(f"a {plan.kind!r} plan is not a step; the runner runs {', '.join(STEP_KINDS)}")
        ctx = self.context(plan, self.layout)
        ids = self.input_ids(plan)
        if self.graphs is not None:
            out = self.graphs.run(ids, ctx)
            if out is not None:
                return out
        return self.model(ids, ctx.positions, ctx)

    def context(self, plan: StepPlan, layout: Any) -> Any:
        """The step's ForwardContext under `layout`, from this rank's tables (or the plan's own)."""
        from splash.worker.context import build_context

        return build_context(plan.seqs, kv=self.pool, layout=layout, comm=self.comm, rank=self.rank,
                                    world=self.world, device=self.device, stats=self.stats,
                                    tables=self.tables if plan.delta is not None else None, state=self.state)

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
        if plan.delta is None and plan.kind in STEP_KINDS:
            plan = decoded(plan, self.encoder.encode(plan))
        hidden = self.forward(plan)
        if plan.row_logprobs is not None:
            plan.row_logprobs.result = self.row_logprobs(hidden, plan.row_logprobs)
        rows = plan.sample_rows()
        if not rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size)
        from splash.model.context import to_device

        idx = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))

    def row_logprobs(self, hidden: torch.Tensor, req: RowLogprobs) -> tuple[torch.Tensor, ...]:
        """Next-token logprobs of `req.rows` (prompt logprobs): the targets' and the top ones, computed
        ROW_CHUNK rows at a time so a long prompt never holds [rows, V] logits at once. Raw logits
        (before any temperature), in the model's dtype (float32 for half types), as the sampler's."""
        from splash.model.context import to_device

        rows = to_device(torch.tensor(req.rows, dtype=torch.long), self.device)
        targets = to_device(torch.tensor(req.targets, dtype=torch.long), self.device)
        got, top_v, top_i = [], [], []
        for a in range(0, len(req.rows), ROW_CHUNK):
            logits = self.model.compute_logits(hidden.index_select(0, rows[a:a + ROW_CHUNK]))
            if logits.dtype in (torch.bfloat16, torch.float16):
                logits = logits.float()
            lp = torch.log_softmax(logits, dim=-1)
            got.append(lp.gather(1, targets[a:a + ROW_CHUNK, None]).squeeze(1))
            if req.top:
                v, i = lp.topk(min(req.top, lp.shape[-1]), dim=-1)
                top_v.append(v)
                top_i.append(i)
        cat = (lambda xs: torch.cat(xs).cpu()) if got else (lambda xs: torch.empty(0))
        return cat(got), cat(top_v) if top_v else None, cat(top_i) if top_i else None

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
        if self.comm is None:
            return []
        return [self.comm.stats.reply(getattr(self.comm, "rank", 0))]

    def shutdown(self) -> None:
        """Nothing to stop on one rank (the GroupRunner stops the others)."""
