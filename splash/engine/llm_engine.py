"""The synchronous engine on rank 0: add requests, run steps, hand back vLLM-shaped snapshots.

One `step()` = schedule -> run the plan on every rank (through the runner) -> sample on rank 0 ->
append tokens, detokenize, check stops -> free the pages of whatever finished.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from splash.config import EngineConfig
from splash.engine import prompt_logprobs
from splash.engine.detokenizer import IncrementalDetokenizer
from splash.engine.outputs import RequestOutput
from splash.engine.recovery import Recovery, StepFailed
from splash.engine.request import Request
from splash.engine.request import Sequence as Seq
from splash.engine.rl import RLControl
from splash.engine.sampler import Sampler, SampleRow
from splash.engine.sampling import SamplingParams
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.kv.allocator import KVAllocator
from splash.kv.books import BooksError
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


class LLMEngine(RLControl, Recovery):
    def __init__(self, runner: StepRunner, allocator: KVAllocator, sched_cfg: SchedulerConfig,
                 tokenizer: Tokenizer | None = None, eos_token_ids: Sequence[int] = (),
                 vocab_size: int | None = None, model_name: str = "model",
                 info: dict[str, Any] | None = None, config: EngineConfig | None = None) -> None:
        # the options it was built from (resolved; a bare engine of tests: the defaults and environment)
        self.config = config if config is not None else EngineConfig.from_kwargs()
        self.runner = runner
        self.allocator = allocator
        self.scheduler = Scheduler(sched_cfg, allocator)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.grammar: Any = None  # GrammarBackend, made when a request first asks for structured output
        self.forward_seconds = 0.0  # wall seconds in the ranks' forward (runner.execute), all steps
        self.generation_defaults: dict[str, Any] = {}  # the checkpoint's sampling defaults (the server's)
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.info = dict(info or {})  # static facts for `stats()` (layout, ranks, dtype, ...)
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.on_step: list[Callable[[dict[str, Any]], None]] = []  # called after every step
        # Debug/test hook: fn(plan, seqs, logits) with rank 0's logits of the plan's sampled rows, before
        # sampling (float64 parity tests compare whole rows across layouts).
        self.logits_hook: Callable[[StepPlan, list[Seq], torch.Tensor], None] | None = None
        # Live layout switching on T > 1 ranks (splash/switch/controller.py): decides and plans a switch
        # into the scheduled step, commits it after the step ran.
        self.switcher: Any = None
        self._closed = False
        self._broken: str | None = None  # why no step can run any more (a failed step left it unsound)
        # Prove the books after every step and control operation (splash/kv/books.py): a bookkeeping
        # error then fails the step that makes it. The test suite and `splash bench soak` turn it on.
        self.check_books = self.config.check_books
        self._rl_init()  # pause, weight updates, memory release (splash/engine/rl.py)
        if self.config.enable_memory_saver is not None:  # (unset: LLM's default, on; a server turns it off)
            self.memory_saver = self.config.enable_memory_saver
        self._routing: Any = None  # RoutingRecorder, made when a request first asks for routed experts
        self._restore: list[int] = []  # KDA hybrids: slots whose rejected drafts' state is taken back
        self.spec_verify_ct = 0  # speculative decoding: verify slices run, drafts in them, drafts accepted
        self.spec_drafts = 0
        self.spec_accepted = 0
        self._spec_init()

    def _spec_init(self) -> None:
        """Speculative decoding (splash/engine/spec.py, splash/engine/mtp.py): the scheduler asks for
        drafts of each decoding sequence, from the n-gram lookup or the last MTP draft phase."""
        self.mtp: Any = None  # the MTP draft phase after each step (splash/engine/mtp.py), when on
        self.depth: Any = None  # `--speculative-policy auto`: spec.DepthPolicy (attached by engine/build.py)
        if not self.config.num_drafts:
            return
        if self.config.speculative_algorithm == "MTP":
            from splash.engine.mtp import MtpDrafter

            self.mtp = MtpDrafter(self.scheduler, self.runner, self._draft_room)
            return
        from splash.engine.spec import ngram_propose

        lo, hi = self.config.speculative_ngram_min_match, self.config.speculative_ngram_max_match

        def propose(seq: Seq, room: int) -> list[int]:
            cap = min(self._draft_room(seq), room)
            return ngram_propose(seq.token_slice(0, seq.num_tokens), cap, lo, hi) if cap > 0 else []

        self.scheduler.proposer = propose

    def _draft_room(self, seq: Seq) -> int:
        """Drafts `seq` may verify in its next step: the depth in force (the policy's, or the configured
        one), none where its next token rule cannot take several rows at once (spec.can_speculate), and
        no more than its max_tokens leaves after the token the verify emits anyway."""
        from splash.engine.spec import can_speculate

        p, n_out = seq.params, len(seq.output_token_ids)
        if not can_speculate(p, n_out, seq.guide):
            return 0
        cap = self.config.num_drafts if self.depth is None else self.depth.k
        return cap if p.max_tokens is None else max(0, min(cap, p.max_tokens - n_out - 1))

    def grammar_backend(self) -> Any:
        """The structured-output compiler (xgrammar over this model's vocabulary), made on first use and
        shared with the sampler; the server compiles through it too (a bad schema is a 400 up front)."""
        if self.grammar is None:
            from splash.engine.grammar import GrammarBackend

            self.grammar = GrammarBackend(self.tokenizer, self.vocab_size or 0, self.eos_token_ids)
            self.sampler.grammar = self.grammar
        return self.grammar

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
        """Bytes each collective sent, per rank, per step and layer tag (gathered from every rank now).

        -> {"ranks": [{"rank", "steps": {step: {(op, tag): bytes}}, "total": {...}}, ...],
            "rows": {step: rows N of that step}} for the recent steps each rank keeps."""
        ranks = self.runner.comm_stats() if hasattr(self.runner, "comm_stats") else []
        rows = dict(getattr(self.runner, "step_rows", {}) or {})
        return {"ranks": ranks, "rows": rows}

    def failure(self) -> BaseException | None:
        """Why no step can run any more (the rank group failed or was shut down, or a failed step left
        the books unsound), or None."""
        if self._broken is not None:
            return RuntimeError(self._broken)
        return self._ranks_failure()

    def _ranks_failure(self) -> BaseException | None:
        probe = getattr(self.runner, "failure", None)
        return probe() if probe is not None else None

    def audit(self, where: str) -> None:
        """With `check_books` on: raise BooksError unless every page and slot is accounted for."""
        if self.check_books and self._broken is None:  # (a broken engine was told already)
            errs = self.scheduler.book_errors()
            if errs:
                self._broken = f"KV books do not balance after {where}: " + "; ".join(errs)
                raise BooksError(self._broken)

    def shutdown(self) -> None:
        """Abort what runs and stop the ranks (T > 1); idempotent, also done at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.switcher is not None:
                self.switcher.close()  # logs the prior and how far the online correction moved it
            self.abort_all()
        finally:
            stop = getattr(self.runner, "shutdown", None)
            if stop is not None:
                stop()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | None = None,
                    prompt_token_ids: Sequence[int] | None = None) -> Request:
        """Queue a request; raise ValueError (one clear line) if it can never be served."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt (text) or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if hasattr(prompt_token_ids, "tolist"):  # a numpy array or a tensor of ids
            prompt_token_ids = prompt_token_ids.tolist()
        odd = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if odd:
            raise ValueError(f"prompt_token_ids must be integers, got {odd[0]!r}")  # (1.7 was cut to 1)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if self.vocab_size is not None:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is "
                             f"{self.max_model_len}; nothing could be generated. Shorten the prompt.")
        cap = self.scheduler.max_seq_tokens()
        if len(ids) >= cap:
            raise ValueError(f"the prompt has {len(ids)} tokens but the whole KV pool holds {cap}; it can "
                             f"never run. Shorten the prompt or give more memory per rank.")
        req = Request(request_id=request_id, prompt_token_ids=ids, params=params, prompt=prompt)
        prompt_logprobs.start(req)  # (when asked: checks the start, makes room)
        for i in range(params.n):
            seq = Seq(group=req, index=i)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                   params.skip_special_tokens,
                                                   params.include_stop_str_in_output)
            if params.structured_outputs is not None:  # (a bad schema: GrammarError, a ValueError)
                seq.guide = self.grammar_backend().guide(params.structured_outputs)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.return_top_p_token_ids:
                seq.top_p_ids = []
            req.seqs.append(seq)
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
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
        return req.output()

    def abort_all(self) -> list[RequestOutput]:
        outs = self.abort_all_unchecked()
        self.audit("abort all")
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduling step; return snapshots of the requests that changed (with
        `final_only`, only of those that finished: offline callers skip building the rest).

        A step that fails raises StepFailed after its requests were aborted and the books checked."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._held:  # paused or memory released: requests wait (splash/engine/rl.py)
            return []
        st = None
        try:
            st = self.scheduler.schedule()
            outs = self._run_step(st, final_only)
            self.audit(f"step {self.steps}")
        except Exception as e:
            out = self._recover(st, e)
            if out is e:
                raise
            raise out from e
        return outs

    def _run_step(self, st: Any, final_only: bool) -> list[RequestOutput]:
        """The scheduled step `st`: run it on every rank, sample, append, finish."""
        changed: dict[str, Request] = {}
        for seq in self.scheduler.finished_by_scheduler:
            self._seq_finished(seq, changed)
        self.scheduler.finished_by_scheduler.clear()
        if st.empty:
            return self._collect(changed, final_only)
        now = time.time()
        for seq in st.seqs:
            if seq.group.metrics.first_scheduled_time is None:
                seq.group.metrics.first_scheduled_time = now
        if self._closed:
            raise RuntimeError("the engine was shut down")
        if self.switcher is not None:
            self.switcher.before_execute(st)
        routing = self._arm_routing(st.seqs)
        prompt_rows = prompt_logprobs.rows_of(st.seqs, st.plan.seqs)  # None unless a request asked
        if prompt_rows is not None:
            st.plan.row_logprobs = prompt_rows[0]
        t0 = time.perf_counter()
        logits = self.runner.execute(st.plan)
        t_exec = time.perf_counter()
        self.forward_seconds += t_exec - t0  # (the rest of a step is rank 0's host work)
        st.executed = True
        if self.switcher is not None:
            self.switcher.after_execute(st)
        if prompt_rows is not None:
            prompt_logprobs.keep(*prompt_rows)
        if routing is not None:
            self._keep_routing(routing, st)
        if self.logits_hook is not None:
            self.logits_hook(st.plan, st.seqs, logits)
        self.scheduler.complete(st)
        self.steps += 1
        for seq, sl in zip(st.seqs, st.plan.seqs):
            # Prompt rows computed for the first time (recompute after preemption is not asked-for work).
            hi = min(sl.start + sl.num_new, len(seq.prompt_token_ids))
            if hi > seq.prompt_high:
                self.prompt_tokens_total += hi - seq.prompt_high
                seq.prompt_high = hi
        to_sample = [seq for seq, sl in zip(st.seqs, st.plan.seqs) if sl.sample]
        if to_sample:
            # each sampled slice's logits rows: one, or a verify slice's last token and drafts
            first, n = [], 0
            for seq in to_sample:
                first.append(n)
                n += 1 + len(seq.draft)
            plain = [i for i, seq in enumerate(to_sample) if not seq.draft]
            rows = [SampleRow(s.params, len(s.output_token_ids), s.generator, s.guide, s.prompt_token_ids,
                              s.output_token_ids) for s in (to_sample[i] for i in plain)]
            idx = first if len(plain) == n else [first[i] for i in plain]
            sampled = dict(zip(plain, self.sampler(logits if len(plain) == n else logits[idx], rows)))
            now = time.time()
            for i, seq in enumerate(to_sample):
                changed[seq.group.request_id] = seq.group
                s = sampled.get(i)
                if s is not None:
                    if seq.top_p_ids is not None and s.top_p_ids is not None:
                        seq.top_p_ids.append(s.top_p_ids)
                    self._append(seq, s.token_id, s.logprobs, now)
                else:
                    self._verify(seq, logits[first[i]:first[i] + 1 + len(seq.draft)], now)
                if seq.status.done:
                    self._seq_finished(seq, changed)
        if self._restore:
            slots, self._restore = self._restore, []
            self.runner.restore_state(slots)
        if self.depth is not None:
            self._decide_depth()
        draft_s = 0.0
        if self.mtp is not None:
            t1 = time.perf_counter()
            self.mtp.after_step(st)
            draft_s = time.perf_counter() - t1
            self.forward_seconds += draft_s
        if self.depth is not None and all(sl.sample and sl.num_new == 1 + len(seq.draft)
                                          for seq, sl in zip(st.seqs, st.plan.seqs)):
            # (the ranks' time: the forward and the draft phase, not rank 0's sampling or pricing)
            self.depth.observe([sl.start + sl.num_new for sl in st.plan.seqs],
                               [sl.num_new for sl in st.plan.seqs], t_exec - t0 + draft_s,
                               self.allocator.layout)
        outs = self._collect(changed, final_only)
        if self.on_step:
            info = {"step": self.steps, "rows": st.plan.num_rows, "sampled": len(to_sample),
                    "finished": [o for o in outs if o.finished]}
            for hook in self.on_step:
                hook(info)
        return outs

    def _decide_depth(self) -> None:
        """Speculation depth of the next step (DepthPolicy) from the running batch as it stands."""
        sch = self.scheduler
        decoding = [s for s in sch.running if s.num_tokens - s.num_computed == 1]
        pending = sum(s.num_tokens - s.num_computed for s in sch.running if s.num_tokens - s.num_computed > 1)
        pending += sum(s.num_tokens for s in sch.waiting)
        others = min(pending, max(0, sch.cfg.max_num_batched_tokens - len(decoding)))
        self.depth.decide(decoding, others, self.allocator.layout)

    def _arm_routing(self, seqs: list[Seq]) -> Any:
        """Record routed experts in this step if some sequence in it asked for them."""
        if not any(s.params.return_routed_experts for s in seqs):
            return None
        if self._routing is None:
            from splash.engine.routing import RoutingRecorder
            from splash.engine.weights import local_model

            self._routing = RoutingRecorder(local_model(self))
        self._routing.arm()
        return self._routing

    def _keep_routing(self, rec: Any, st: Any) -> None:
        ids = rec.take()
        if ids is None:
            return
        row = 0
        for seq, sl in zip(st.seqs, st.plan.seqs):
            if seq.params.return_routed_experts:
                seq.keep_routing(sl.start, ids[row:row + sl.num_new])
            row += sl.num_new

    def _verify(self, seq: Seq, rows: torch.Tensor, now: float) -> None:
        """A verify slice's logits [1 + drafts, V]: accept drafts, append the tokens (stopping where a
        stop rule ends the sequence), and count the accepted rows as computed."""
        from splash.engine.spec import accept_greedy, accept_sampled, row_logprobs, target_probs

        p, draft = seq.params, seq.draft
        if p.greedy:
            targets = rows.argmax(dim=-1).tolist()
            toks = targets[:accept_greedy(targets, draft) + 1]
        else:
            toks = accept_sampled(target_probs(rows, p), draft, seq.generator)
        seq.spec_verify_ct += 1
        seq.spec_accepted += len(toks) - 1
        if self.depth is not None:
            self.depth.verified(seq, len(draft), len(toks) - 1)
        self.spec_verify_ct += 1
        self.spec_drafts += len(draft)
        self.spec_accepted += len(toks) - 1
        for j, tok in enumerate(toks):
            lp = row_logprobs(rows[j], tok, p) if p.logprobs is not None else None
            self._append(seq, tok, lp, now)
            if seq.status.done:
                return
        if seq.slot >= 0 and len(toks) - 1 < len(draft):
            # A KDA hybrid's state went through every verify row: the ranks put back its snapshot from
            # before the step, and the known row, the accepted drafts and the new token are replayed
            # as a chunk next step (their MLA KV is rewritten with the same values).
            self._restore.append(seq.slot)
            self.scheduler.rewind(seq, seq.num_computed - 1)
            return
        self.scheduler.accept(seq, len(toks) - 1)

    def _append(self, seq: Seq, tok: int, logprobs: dict[int, float] | None, now: float) -> None:
        """Add a sampled token and decide whether the sequence ends here (vLLM's stop order)."""
        p = seq.params
        seq.output_token_ids.append(tok)
        # the structured output is complete (its stop token was taken), or the grammar refused a token
        # its own mask allowed: either way nothing more may follow
        grammar_done = False
        if seq.guide is not None:
            t0 = time.perf_counter()
            grammar_done = not seq.guide.accept([tok]) or seq.guide.terminated
            self.grammar.seconds["accept"] += time.perf_counter() - t0
        self.generation_tokens_total += 1
        m = seq.group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        n_out = len(seq.output_token_ids)
        may_stop = n_out >= p.min_tokens
        if may_stop and not p.ignore_eos and tok in self.eos_token_ids:
            seq.finish("stop")
            return
        if may_stop and tok in p.stop_token_ids:
            seq.finish("stop", tok)
            return
        if seq.detok is not None and not p.stop:
            seq.detok.defer(tok)
        elif seq.detok is not None:
            delta = seq.detok.add(tok)
            if may_stop:
                hit = seq.detok.find_stop(len(delta))
                if hit is not None:
                    seq.finish("stop", hit)
                    return
        if grammar_done:
            seq.finish("stop")
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish("length")

    def _seq_finished(self, seq: Seq, changed: dict[str, Request]) -> None:
        if seq.detok is not None and seq.finish_reason == "length":
            seq.detok.flush()
        self.scheduler.free(seq)
        changed[seq.group.request_id] = seq.group

    def _collect(self, changed: dict[str, Request], final_only: bool = False) -> list[RequestOutput]:
        outs = []
        for rid, req in changed.items():
            if req.finished:
                req.metrics.finished_time = time.time()
                self.requests.pop(rid, None)
            elif final_only:
                continue
            outs.append(req.output())
        return outs

    # ---- introspection -------------------------------------------------------------------------
    def _plan_bytes_p50(self) -> int | None:
        """Median bytes of the step message rank 0 sends (splash/step/wire.py) over forward steps with
        no prefill rows; None before any such step."""
        probe = getattr(self.runner, "decode_plan_bytes_p50", None)
        return probe() if probe is not None else None

    def stats(self) -> dict[str, Any]:
        a = self.allocator
        used, total = a.num_used, a.num_total
        return {
            **self.info,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_tokens": sum(s.num_tokens for s in self.scheduler.waiting),  # (routers' load)
            "num_requests": len(self.requests),
            "kv_pages_used": sum(used),
            "kv_pages_total": sum(total),
            "kv_pages_used_per_rank": used,
            "kv_usage": (max(u / t for u, t in zip(used, total)) if total and min(total) else 0.0),
            "kv_pool_tokens": self.kv_pool_tokens,
            "kv_distinct_tokens": self.kv_pool_tokens,
            "kv_pool_tokens_per_rank": [t * a.page_size for t in total],
            # KDA hybrids: state slots (one per admitted request; 0 / 0 without per-request state)
            "state_slots_used": a.slots.num_used if a.slots is not None else 0,
            "state_slots_total": a.slots.num_slots if a.slots is not None else 0,
            "max_request_tokens": self.max_request_tokens,
            "page_size": a.page_size,
            "layout": a.layout,
            "ranks": a.world,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.scheduler.cfg.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.cfg.max_num_batched_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "speculative_algorithm": self.config.speculative_algorithm if self.scheduler.proposer else None,
            "speculative_num_draft_tokens": self.config.num_drafts + 1 if self.scheduler.proposer else None,
            "speculative_policy": self.config.speculative_policy if self.scheduler.proposer else None,
            "speculative_depth": (None if not self.scheduler.proposer else
                                  self.depth.k if self.depth is not None else self.config.num_drafts),
            "spec_depth_changes": self.depth.changes if self.depth is not None else 0,
            "spec_verify_ct": self.spec_verify_ct,
            "spec_draft_tokens": self.spec_drafts,
            "spec_accepted_tokens": self.spec_accepted,
            # tokens per verify slice (SGLang's spec_accept_length: the accepted drafts plus the bonus)
            "spec_accept_length": (1 + self.spec_accepted / self.spec_verify_ct if self.spec_verify_ct
                                   else None),
            "steps": self.steps,
            "decode_plan_bytes_p50": self._plan_bytes_p50(),
            **(self.switcher.stats() if self.switcher is not None else {}),
            **(a.cache.stats() if a.cache is not None else {}),
            "prefix_caching": a.cache is not None,
            **self.rl_stats(),
        }
