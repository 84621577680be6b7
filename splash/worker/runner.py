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

# draft phases over up to this many rows run the MTP block over all of them, not the KV alone plus the block
# over the chain rows (trained-mtp f32, batch 1: 0.36 + 0.64 ms -> ~0.7 ms; per-op cost dominates both)
WHOLE_ROWS = 8
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
                 world: int = 1, kernels: Any = None) -> None:
        self.model = model
        self.pool = pool
        self.layout = layout
        # the rank's attention kernels (splash/attention/kernels.py), built once: every layout of this
        # runner, a live switch's included, and its CUDA graphs use it (default: the layout's own)
        self.kernels = kernels if kernels is not None else layout.kernels
        self.comm = comm
        self.rank = rank
        self.world = world
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.stats: dict[str, Any] = {}
        self.step_rows: OrderedDict[int, int] = OrderedDict()  # step -> rows N (recent steps only)
        self.tables = RankTables()  # this rank's page tables of the live requests (from step messages)
        self.state: Any = None  # a KDA hybrid's StatePool (splash/kv/state.py): its requests' slots
        self._encoder: wire.PlanEncoder | None = None
        # speculative decoding with MTP layers: the last step's hidden states [N, d], which the draft
        # phase after it reads (None while the model serves no MTP layer)
        self.last_hidden: torch.Tensor | None = None
        # ... and that step's slices, input ids and whether its plan carried its own page tables: the rows
        # it made final get their draft KV at the start of the next step when no draft phase ran between
        # (extend_lagged)
        self._last_rows: tuple[list[Any], np.ndarray, bool] | None = None
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
        mtp = bool(getattr(self.model, "mtp", None))
        if mtp:
            self.extend_lagged(plan)  # (before this step's tables and layout replace the last step's)
        if plan.delta is not None:
            plan.delta.apply(self.tables, self.rank)
        if self.state is not None:
            self.state.forget_snapshot()
            if plan.snapshot:  # (a KDA hybrid's verify slices: rank 0 may take their rows back)
                self.state.arm_snapshot(plan.snapshot)
        if plan.kind == "switch":
            out = run_switch_step(self, plan)
        elif plan.kind != "forward":
            raise ValueError(f"a {plan.kind!r} plan is not a step; the runner runs {', '.join(STEP_KINDS)}")
        else:
            ctx = self.context(plan, self.layout)
            ids = self.input_ids(plan)
            out = self.graphs.run(ids, ctx) if self.graphs is not None else None
            if out is None:
                out = self.model(ids, ctx.positions, ctx)
        if mtp:
            self.last_hidden = out
            self._last_rows = (plan.seqs, np.asarray(plan.input_ids, dtype=np.int64), plan.delta is None)
        return out

    def extend_lagged(self, plan: StepPlan) -> None:
        """The MTP layer's draft KV of the rows the last step made final, where no draft phase followed
        it (rank 0 runs none when no request drafts next: splash/engine/mtp.py). It is the extend that
        phase would have run, one step late: this step's slices say how far each request got (its
        `start`: rows last.start .. start - 1 are final) and carry the token after the last of them (its
        first input). Every rank decides alike from the same plans; a request absent from this step
        (finished, preempted) gets none, as it would from the phase. Runs under the last step's tables
        and layout, so a switch in this step moves these rows with the rest."""
        last, self._last_rows = self._last_rows, None
        hidden = self.last_hidden
        if last is None or hidden is None or not plan.seqs:
            return
        from splash.model.context import to_device
        from splash.step.plan import SeqSlice

        prev, prev_ids, own = last
        cur = np.asarray(plan.input_ids, dtype=np.int64)
        now: dict[int, tuple[int, int]] = {}
        row = 0
        for s in plan.seqs:
            now[s.req_id] = (s.start, row)
            row += s.num_new
        sel: list[SeqSlice] = []
        src: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        first = 0
        for s in prev:
            start, at = now.get(s.req_id, (s.start, 0))
            n = start - s.start
            if 0 < n <= s.num_new:
                sel.append(SeqSlice(s.req_id, s.start, n, s.owner, s.pages, False, s.slot))
                src.append(np.arange(first, first + n))
                ids.append(prev_ids[first + 1:first + n])
                ids.append(cur[at:at + 1])
            first += s.num_new
        if not sel:
            return
        # (no state pool: a lagged slice starting at 0 must not zero a KDA slot the last step advanced)
        ctx = self.context_of(sel, self.layout, own=own, state=False)
        nxt = to_device(torch.from_numpy(np.concatenate(ids)), self.device)
        self._extend(hidden, np.concatenate(src), nxt, ctx)

    def _extend(self, hidden: torch.Tensor, src: np.ndarray, ids: torch.Tensor, ctx: Any,
                whole: bool = False) -> torch.Tensor:
        """The MTP extend over rows `src` of `hidden` (the target's, before the final norm) with their next
        tokens `ids`: writes their draft KV -> their block inputs (the draft phase's and the lagged one),
        or with `whole` the block's outputs (`draft_extend`)."""
        from splash.model.context import to_device

        m = self.model
        h = m.norm(hidden.index_select(0, to_device(torch.from_numpy(src), self.device)))
        return m.draft_extend(ids, h, ctx, whole=whole)

    @torch.inference_mode()
    def draft(self, plan: StepPlan) -> torch.Tensor | None:
        """The draft phase after a step (speculative decoding with MTP layers, splash/engine/mtp.py), the
        same on every rank: the MTP layer over the rows the step made final (their hidden states after the
        final norm, the next tokens' embeddings), which writes their draft KV, then `chain[i]` greedy
        drafts from each slice's last row, one MTP row per request and draft. -> [slices with a chain,
        max chain] draft ids (-1 past a slice's own), or None."""
        if plan.delta is None:  # a plan as rank 0's engine made it (T = 1): through the message
            plan = decoded(plan, self.encoder.encode(plan))
        plan.delta.apply(self.tables, self.rank)
        hidden, self.last_hidden = self.last_hidden, None
        if not plan.seqs:
            return None
        if hidden is None:
            raise RuntimeError(f"rank {self.rank}: a draft plan arrived without a step before it")
        from splash.model.context import to_device
        from splash.step.plan import SeqSlice

        work, m, dev = plan.payload, self.model, self.device
        src = np.concatenate([np.arange(a, a + s.num_new) for a, s in zip(work.src, plan.seqs)])
        # every row's draft KV (cheap: no attention), then the whole block where a chain starts; or, for
        # a few rows, the whole block over all of them at once (WHOLE_ROWS)
        chain = [(i, n) for i, n in enumerate(work.chain) if n > 0]
        whole = bool(chain) and len(src) <= WHOLE_ROWS
        x = self._extend(hidden, src, self.input_ids(plan), self.context(plan, self.layout), whole)
        if not chain:
            return None
        ends = np.cumsum([s.num_new for s in plan.seqs]) - 1
        rows = to_device(torch.tensor([int(ends[i]) for i, _ in chain], dtype=torch.long), dev)
        if whole:
            hn, logits = m.draft_head(x.index_select(0, rows))
        else:
            first = [SeqSlice(plan.seqs[i].req_id, plan.seqs[i].end - 1, 1, plan.seqs[i].owner, [], True)
                     for i, _ in chain]
            hn, logits = m.draft_head(m.draft_block(x.index_select(0, rows),
                                                    self.context_of(first, self.layout)))
        tok = logits.argmax(dim=-1)
        out = torch.full((len(chain), max(n for _, n in chain)), -1, dtype=torch.long, device=dev)
        out[:, 0] = tok
        seqs = [plan.seqs[i] for i, _ in chain]
        cur = list(range(len(chain)))  # rows of `out` still chaining; `hn` holds theirs
        for j in range(1, out.shape[1]):  # chain step j: position end + j - 1, input draft j - 1
            keep = [k for k, c in enumerate(cur) if chain[c][1] > j]
            if len(keep) < len(cur):
                hn = hn.index_select(0, to_device(torch.tensor(keep, dtype=torch.long), dev))
                cur = [cur[k] for k in keep]
            at = to_device(torch.tensor(cur, dtype=torch.long), dev)
            step = [SeqSlice(seqs[c].req_id, seqs[c].end + j - 1, 1, seqs[c].owner, [], True) for c in cur]
            hn, logits = m.draft_head(m.draft_forward(out.index_select(0, at)[:, j - 1], hn,
                                                      self.context_of(step, self.layout)))
            out[at, j] = logits.argmax(dim=-1)
        return out

    @torch.inference_mode()
    def restore_state(self, slots: list[int]) -> None:
        """Put back the snapshot of `slots` the last step took (its speculative rows were rejected)."""
        self.state.restore_snapshot(slots)

    @torch.inference_mode()
    def copy_state(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state rows src -> dst in order (a hybrid's prefix snapshots saved and loaded)."""
        self.state.copy_slots(pairs)

    def context(self, plan: StepPlan, layout: Any) -> Any:
        """The step's ForwardContext under `layout`, from this rank's tables (or the plan's own)."""
        return self.context_of(plan.seqs, layout, own=plan.delta is None)

    def context_of(self, seqs: Any, layout: Any, own: bool = False, state: bool = True) -> Any:
        """A ForwardContext of `seqs` under `layout`: from this rank's tables, or (`own`) the slices';
        with this rank's state pool unless `state` is False."""
        from splash.worker.context import build_context

        return build_context(seqs, kv=self.pool, layout=layout, comm=self.comm, rank=self.rank,
                             world=self.world, device=self.device, stats=self.stats,
                             tables=None if own else self.tables, state=self.state if state else None)

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
