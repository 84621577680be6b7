"""The synchronous engine on rank 0: add requests, run steps, hand back vLLM-shaped snapshots.

One `step()` = schedule (with the drafts a verify slice checks) -> execute the plan on every rank
(through the runner) -> sample on rank 0 -> commit each token (append, stop rules) -> free whatever
finished. Every feature around that - speculation and its depth, grammars, prompt logprobs, routed
experts, detokenizing, logprobs, metrics, live switching - is a stage (splash/engine/stages/) called at
fixed points of the step, keeping its own per-request state; RL control and a failed step's cleanup are
parts (`rl`, `recovery`) whose public names the engine still answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from splash.engine.outputs import RequestOutput
from splash.engine.recovery import Recovery, StepFailed
from splash.engine.request import Request, prompt_ids
from splash.engine.request import Sequence as Seq
from splash.engine.rl import RLControl
from splash.engine.sampler import Sampled, Sampler, SampleRow
from splash.engine.sampling import SamplingParams
from splash.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from splash.engine.stages import PARTS, Delegate, build_stages
from splash.engine.stats import comm_stats, engine_stats
from splash.kv.allocator import KVAllocator
from splash.runtime_spec import RuntimeSpec
from splash.step.plan import StepPlan

log = logging.getLogger("splash.engine")
__all__ = ["LLMEngine", "StepFailed", "StepRunner", "Tokenizer"]


class StepRunner(Protocol):
    """Runs one plan on every rank and returns rank 0's logits of the plan's sample rows."""

    device: torch.device

    def execute(self, plan: StepPlan) -> torch.Tensor: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class LLMEngine:
    def __init__(self, spec: RuntimeSpec, runner: StepRunner, allocator: KVAllocator,
                 tokenizer: Tokenizer | None = None, *, info: dict[str, Any] | None = None,
                 weight_pages: Sequence[int] | None = None) -> None:
        """The engine of `spec` (splash/engine/resolve.py; tests: `RuntimeSpec.for_tests`) over `runner`
        and `allocator`: it builds its scheduler and, on T > 1 ranks, its switch controller from the
        spec, complete; `weight_pages`: the ranks' measured replica pages (`RankFacts.replica_pages`)."""
        self.spec = spec
        self.config = spec.config  # the options it was built from (resolved)
        self.runner = runner
        self.allocator = allocator
        self.scheduler = Scheduler(SchedulerConfig.of(spec.config), allocator)
        self.tokenizer = tokenizer
        self.eos_token_ids = spec.eos_token_ids
        self.sampler = Sampler(self.eos_token_ids)
        self.forward_seconds = 0.0  # wall seconds in the ranks' forward (runner.execute), all steps
        self.last_forward_s = 0.0  # the last step's (the depth policy's measurement)
        self.generation_defaults = dict(spec.generation_defaults)  # the checkpoint's sampling defaults
        self.vocab_size = spec.vocab_size
        self.model_name = spec.model_name
        self.info = dict(info or {})  # static facts for `stats()` (layout, ranks, dtype, ...)
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.on_step: list[Callable[[dict[str, Any]], None]] = []  # called after every step
        # Debug/test hook: fn(plan, seqs, logits) with rank 0's logits of the plan's sampled rows, before
        # sampling (float64 parity tests compare whole rows across layouts).
        self.logits_hook: Callable[[StepPlan, list[Seq], torch.Tensor], None] | None = None
        # Live layout switching on T > 1 ranks (splash/switch/controller.py): decides and plans a switch
        # into the scheduled step, commits it after the step ran.
        self.switcher: Any = None
        self._closed = False
        # Prove the books after every step and control operation (splash/kv/books.py): a bookkeeping
        # error then fails the step that makes it. The test suite and `splash bench soak` turn it on.
        self.check_books = self.config.check_books
        self.rl = RLControl(self, spec.model_path or None)  # pause, weight updates, memory release
        if self.config.enable_memory_saver is not None:  # (unset: LLM's default, on; a server turns it off)
            self.memory_saver = self.config.enable_memory_saver
        self.recovery = Recovery(self)  # the books proved, a failed step cleaned up (engine/recovery.py)
        self.stages = build_stages(self)  # every feature around the step (splash/engine/stages/)
        if spec.world > 1:  # (always: benchmarks `request()` switches too)
            from splash.switch.controller import SwitchController

            self.switcher = SwitchController(self, spec, weight_pages=weight_pages)

    # ---- properties ------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler.cfg.max_model_len

    @property
    def kv_pool_tokens(self) -> int:
        """Distinct tokens the group can hold under its layout (TP: one rank's pool; else the sum)."""
        return self.allocator.pool_tokens()

    @property
    def max_request_tokens(self) -> int:
        """Longest context one request can ever have: the model's context, and the largest pool that a
        single owner (DP/DOP), the replicated pool (TP) or the position shards (CP) give one request."""
        return self.scheduler.max_seq_tokens()

    @property
    def world(self) -> int:
        return self.allocator.world

    def comm_stats(self) -> dict[str, Any]:
        """Bytes each collective sent, per rank, per step and layer tag (splash/engine/stats.py)."""
        return comm_stats(self.runner)

    def shutdown(self) -> None:
        """Abort what runs and stop the ranks (T > 1); idempotent, also done at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.switcher is not None:
                self.switcher.close()  # logs the prior and how far the online correction moved it
            self.abort_all()
            self.pd.close()  # (its transfer engine's memory unregistered: a peer's write now fails)
        finally:
            stop = getattr(self.runner, "shutdown", None)
            if stop is not None:
                stop()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | None = None,
                    prompt_token_ids: Sequence[int] | None = None) -> Request:
        """Queue a request; raise ValueError (one clear line) if it can never be served."""
        req = self.new_request(request_id, prompt, params, prompt_token_ids)
        for seq in req.seqs:
            self.scheduler.add(seq)
        return req

    def new_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: Sequence[int] | None = None) -> Request:
        """A checked request, its sequences known to every stage and the request in `requests`, but not
        queued: `add_request` queues it, a decode engine of prefill/decode disaggregation parks it."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        ids = prompt_ids(prompt, prompt_token_ids, self.tokenizer, self.vocab_size, self.max_model_len,
                         self.scheduler.max_seq_tokens())
        req = Request(request_id=request_id, prompt_token_ids=ids, params=params, prompt=prompt)
        req.seqs = [Seq(group=req, index=i) for i in range(params.n)]
        try:
            for seq in req.seqs:
                if params.seed is not None:
                    seq.generator = torch.Generator(device=self.runner.device)
                    seq.generator.manual_seed(params.seed + seq.index)
                for hook in self.stages.on_add:  # (a bad schema or prompt-logprobs start: a ValueError)
                    hook(seq)
        except BaseException:
            self.stages.drop(req)
            raise
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its final snapshot (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.status.done:
                seq.finish("abort")
            self.scheduler.free(seq)
        req.metrics.finished_time = time.time()
        return self.stages.snapshot(req, final=True)

    def abort_all(self) -> list[RequestOutput]:
        outs = self.recovery.abort_all_unchecked()
        self.audit("abort all")
        return outs

    def has_unfinished(self) -> bool:
        """Requests that a step can advance (a parked one waits for its KV, not for a step; its n
        sequences are parked together)."""
        return len(self.requests) > len({id(s.group) for s in self.scheduler.parked})

    # ---- the step ------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduling step; return snapshots of the requests that changed (with
        `final_only`, only of those that finished: offline callers skip building the rest).

        A step that fails raises StepFailed after its requests were aborted and the books checked."""
        if self.recovery.broken is not None:
            raise RuntimeError(self.recovery.broken)
        if self.rl.is_paused:  # paused or memory released: requests wait (splash/engine/rl.py)
            return []
        st = None
        try:
            st = self.scheduler.schedule()
            outs = self._run_step(st, final_only)
            self.audit(f"step {self.steps}")
        except Exception as e:
            out = self.recovery.recover(st, e)
            if out is e:
                raise
            raise out from e
        return outs

    def _run_step(self, st: ScheduledStep, final_only: bool) -> list[RequestOutput]:
        """The scheduled step `st` (its drafts chosen with it): execute on every rank, sample, commit."""
        changed: dict[str, Request] = {}
        for seq in self.scheduler.finished_by_scheduler:
            self._seq_finished(seq, changed)
        self.scheduler.finished_by_scheduler.clear()
        if st.empty:
            return self._collect(changed, final_only)
        if self._closed:
            raise RuntimeError("the engine was shut down")
        for hook in self.stages.before_execute:  # a switch planned in, routing armed, prompt-logprob rows
            hook(st)
        t0 = time.perf_counter()
        logits = self.runner.execute(st.plan)
        self.last_forward_s = time.perf_counter() - t0
        self.forward_seconds += self.last_forward_s  # (the rest of a step is rank 0's host work)
        st.executed = True
        for hook in self.stages.after_execute:  # the switch committed, what the step recorded kept
            hook(st, logits)
        if self.logits_hook is not None:
            self.logits_hook(st.plan, st.seqs, logits)
        self.scheduler.complete(st)
        self.steps += 1
        sampled = self._sample(st, logits, changed)
        for hook in self.stages.after_step:  # MTP's draft phase, the next depth
            hook(st)
        outs = self._collect(changed, final_only)
        if self.on_step:
            info = {"step": self.steps, "rows": st.plan.num_rows, "sampled": sampled,
                    "finished": [o for o in outs if o.finished]}
            for fn in self.on_step:
                fn(info)
        return outs

    def _sample(self, st: ScheduledStep, logits: torch.Tensor, changed: dict[str, Request]) -> int:
        """Draw the step's tokens and commit them: plain rows through the sampler, each verify slice's
        rows (its last token and drafts) through speculation. -> the sequences sampled."""
        drafts = st.drafts
        to_sample = [seq for seq, sl in zip(st.seqs, st.plan.seqs) if sl.sample]
        if not to_sample:
            return 0
        first, n = [], 0
        for seq in to_sample:
            first.append(n)
            n += 1 + len(drafts.get(seq, ()))
        plain = [i for i, seq in enumerate(to_sample) if seq not in drafts]
        guides = self.guided.guides
        rows = [SampleRow(s.params, len(s.output_token_ids), s.generator, guides.get(s), s.prompt_token_ids,
                          s.output_token_ids) for s in (to_sample[i] for i in plain)]
        idx = first if len(plain) == n else [first[i] for i in plain]
        sampled = dict(zip(plain, self.sampler(logits if len(plain) == n else logits[idx], rows)))
        now = time.time()
        for i, seq in enumerate(to_sample):
            changed[seq.group.request_id] = seq.group
            s = sampled.get(i)
            if s is not None:
                self.commit(seq, s, now)
            else:
                d = drafts[seq]
                self.speculation.verify(seq, d, logits[first[i]:first[i] + 1 + len(d)], now)
            if seq.status.done:
                self._seq_finished(seq, changed)
        return len(to_sample)

    def commit(self, seq: Seq, s: Sampled, now: float) -> None:
        """Append a sampled token and decide whether the sequence ends here, in vLLM's order: the stop
        tokens, then each stage's check (stop strings, a grammar's end), then the length."""
        p, tok = seq.params, s.token_id
        seq.output_token_ids.append(tok)
        for hook in self.stages.on_token:  # (the grammar advances, counters and logprobs)
            hook(seq, s, now)
        n_out = len(seq.output_token_ids)
        may_stop = n_out >= p.min_tokens
        if may_stop and not p.ignore_eos and tok in self.eos_token_ids:
            return seq.finish("stop")
        if may_stop and tok in p.stop_token_ids:
            return seq.finish("stop", tok)
        for check in self.stages.check_stop:
            hit = check(seq, tok, may_stop)
            if hit is not None:
                return seq.finish(*hit)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish("length")
        return None

    def _seq_finished(self, seq: Seq, changed: dict[str, Request]) -> None:
        for hook in self.stages.on_finish:
            hook(seq)
        self.scheduler.free(seq)
        changed[seq.group.request_id] = seq.group

    def _collect(self, changed: dict[str, Request], final_only: bool = False) -> list[RequestOutput]:
        outs = []
        for rid, req in changed.items():
            if req.finished:
                req.metrics.finished_time = time.time()
                self.requests.pop(rid, None)
                outs.append(self.stages.snapshot(req, final=True))
            elif not final_only:
                outs.append(self.stages.snapshot(req))
        return outs

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return engine_stats(self)


# The names the engine answers for its parts (callers keep them: the server, splash.Engine, LLM, tests).
for _part, _names in {"rl": RLControl.NAMES, "recovery": Recovery.NAMES, **PARTS}.items():
    Delegate.install(LLMEngine, _part, _names)
