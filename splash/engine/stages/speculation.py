"""Speculative decoding as a stage: the drafts' source (n-gram lookup or the MTP draft phase), the depth
in force (configured, or `--speculative-policy auto`'s DepthPolicy, built here), verifying a slice's
drafts, a KDA hybrid's state taken back after a rejection, and the counters (per request and engine-wide).

The math (proposals, acceptance, the depth policy) is splash/engine/spec.py and the MTP draft plan
splash/engine/mtp.py; this file is where they meet the step. Each sequence's verify record lives in
this stage's table (`SpecState`), not on the sequence; the drafts a step verifies are the step's own
(`ScheduledStep.drafts`, chosen by the scheduler through `Scheduler.proposer`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled
from splash.engine.spec import (
    DepthPolicy,
    accept_greedy,
    accept_sampled,
    can_speculate,
    ngram_propose,
    row_logprobs,
    target_probs,
)
from splash.engine.stages.base import Stage


class SpecState:
    """One sequence's verify record: what its output reports (SGLang's `spec_verify_ct`) and what the
    depth policy estimates its acceptance from (it reads `recent_accepted`, `recent_rejected`,
    `num_computed`)."""

    __slots__ = ("seq", "spec_verify_ct", "spec_accepted", "spec_rejected", "recent_accepted",
                 "recent_rejected")

    def __init__(self, seq: Seq) -> None:
        self.seq = seq
        self.spec_verify_ct = 0  # verify steps it took part in
        self.spec_accepted = 0  # drafts accepted in them
        self.spec_rejected = 0  # verifies that stopped at a rejected draft
        self.recent_accepted = 0.0  # the same two counts with older verifies decayed (DepthPolicy.verified)
        self.recent_rejected = 0.0

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed


class Speculation(Stage):
    """`--speculative-algorithm NGRAM|MTP` with `--speculative-num-draft-tokens` > 1 (else inert).
    `NAMES`: what the engine answers for it (benchmarks and tests read them)."""

    NAMES = {"depth": "depth", "mtp": "mtp", "spec_verify_ct": "spec_verify_ct", "spec_drafts": "spec_drafts",
             "spec_accepted": "spec_accepted", "_draft_room": "draft_room"}

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.per_seq: dict[Seq, SpecState] = {}
        self.spec_verify_ct = 0  # engine-wide: verify slices run, drafts in them, drafts accepted
        self.spec_drafts = 0
        self.spec_accepted = 0
        self.restore: list[int] = []  # KDA hybrids: slots whose rejected drafts' state is taken back
        self.mtp: Any = None  # the MTP draft phase after each step (splash/engine/mtp.py), when on
        self.depth: DepthPolicy | None = None  # `--speculative-policy auto`
        c = engine.config
        if not c.num_drafts:
            return
        if c.speculative_algorithm == "MTP":
            from splash.engine.mtp import MtpDrafter

            self.mtp = MtpDrafter(engine.scheduler, engine.runner, self.draft_room)
        else:
            lo, hi = c.speculative_ngram_min_match, c.speculative_ngram_max_match

            def propose(seq: Seq, room: int) -> list[int]:
                cap = min(self.draft_room(seq), room)
                return ngram_propose(seq.token_slice(0, seq.num_tokens), cap, lo, hi) if cap > 0 else []

            engine.scheduler.proposer = propose
        if c.speculative_policy == "auto":
            self.depth = depth_policy(engine)

    def draft_room(self, seq: Seq) -> int:
        """Drafts `seq` may verify in its next step: the depth in force (the policy's, or the configured
        one), none where its next token rule cannot take several rows at once (spec.can_speculate), and
        no more than its max_tokens leaves after the token the verify emits anyway."""
        p, n_out = seq.params, len(seq.output_token_ids)
        if not can_speculate(p, n_out, self.engine.guided.guides.get(seq)):
            return 0
        cap = self.engine.config.num_drafts if self.depth is None else self.depth.k
        return cap if p.max_tokens is None else max(0, min(cap, p.max_tokens - n_out - 1))

    def verify(self, seq: Seq, draft: list[int], rows: torch.Tensor, now: float) -> None:
        """A verify slice's logits [1 + drafts, V]: accept drafts, commit the tokens (stopping where a
        stop rule ends the sequence), and count the accepted rows as computed."""
        p, eng = seq.params, self.engine
        if p.greedy:
            targets = rows.argmax(dim=-1).tolist()
            toks = targets[:accept_greedy(targets, draft) + 1]
        else:
            toks = accept_sampled(target_probs(rows, p), draft, seq.generator)
        st = self.per_seq.get(seq)
        if st is None:
            st = self.per_seq[seq] = SpecState(seq)
        st.spec_verify_ct += 1
        st.spec_accepted += len(toks) - 1
        if self.depth is not None:
            self.depth.verified(st, len(draft), len(toks) - 1)
        self.spec_verify_ct += 1
        self.spec_drafts += len(draft)
        self.spec_accepted += len(toks) - 1
        for j, tok in enumerate(toks):
            lp = row_logprobs(rows[j], tok, p) if p.logprobs is not None else None
            eng.commit(seq, Sampled(tok, lp), now)
            if seq.status.done:
                return
        if seq.slot >= 0 and len(toks) - 1 < len(draft):
            # A KDA hybrid's state went through every verify row: the ranks put back its snapshot from
            # before the step, and the known row, the accepted drafts and the new token are replayed
            # as a chunk next step (their MLA KV is rewritten with the same values).
            self.restore.append(seq.slot)
            eng.scheduler.rewind(seq, seq.num_computed - 1)
            return
        eng.scheduler.accept(seq, len(toks) - 1)

    def after_step(self, st: Any) -> None:
        """Take back rejected KDA state, decide the next depth, run MTP's draft phase, time the step."""
        eng = self.engine
        if self.restore:
            slots, self.restore = self.restore, []
            eng.runner.restore_state(slots)
        if self.depth is not None:
            self._decide_depth()
        draft_s = 0.0
        if self.mtp is not None:
            t1 = time.perf_counter()
            self.mtp.after_step(st)
            draft_s = time.perf_counter() - t1
            eng.forward_seconds += draft_s
        if self.depth is not None and all(sl.sample and sl.num_new == 1 + len(st.drafts.get(seq, ()))
                                          for seq, sl in zip(st.seqs, st.plan.seqs)):
            # (the ranks' time: the forward and the draft phase, not rank 0's sampling or pricing)
            self.depth.observe([sl.start + sl.num_new for sl in st.plan.seqs],
                               [sl.num_new for sl in st.plan.seqs], eng.last_forward_s + draft_s,
                               eng.allocator.layout)

    def _decide_depth(self) -> None:
        """Speculation depth of the next step (DepthPolicy) from the running batch as it stands."""
        assert self.depth is not None
        sch = self.engine.scheduler
        decoding = [s for s in sch.running if s.num_tokens - s.num_computed == 1]
        joining = len(sch.running) - len(decoding) + len(sch.waiting)  # (prefilling: the batch being built)
        joining = min(joining, max(0, sch.cfg.max_num_seqs - len(decoding)))
        records = [self.per_seq.get(s) or SpecState(s) for s in decoding]
        self.depth.decide(records, joining, self.engine.allocator.layout)

    def output(self, seq: Seq, fields: dict[str, Any]) -> None:
        st = self.per_seq.get(seq)
        if st is not None:
            fields["spec_verify_ct"] = st.spec_verify_ct

    def on_drop(self, seq: Seq) -> None:
        self.per_seq.pop(seq, None)
        if self.mtp is not None:
            self.mtp.drafts.pop(seq, None)

    def stats(self) -> dict[str, Any]:
        c, on = self.engine.config, self.engine.scheduler.proposer is not None
        return {
            "speculative_algorithm": c.speculative_algorithm if on else None,
            "speculative_num_draft_tokens": c.num_drafts + 1 if on else None,
            "speculative_policy": c.speculative_policy if on else None,
            "speculative_depth": None if not on else self.depth.k if self.depth is not None else c.num_drafts,
            "spec_depth_changes": self.depth.changes if self.depth is not None else 0,
            "spec_verify_ct": self.spec_verify_ct,
            "spec_draft_tokens": self.spec_drafts,
            "spec_accepted_tokens": self.spec_accepted,
            # tokens per verify slice (SGLang's spec_accept_length: the accepted drafts plus the bonus)
            "spec_accept_length": (1 + self.spec_accepted / self.spec_verify_ct if self.spec_verify_ct
                                   else None),
        }


def depth_policy(engine: Any) -> DepthPolicy:
    """`--speculative-policy auto`'s DepthPolicy for `engine`: the layout policy's theta prior (--theta,
    or the device's default), margin and dwell, priced for its model and the pool's element format."""
    from splash.core.model_config import dtype_name
    from splash.core.prior import load_or_default_theta
    from splash.core.sizes import AttentionSizes
    from splash.core.spec_depth import DepthConfig
    from splash.engine.weights import local_model

    c, world = engine.config, engine.allocator.world
    spec = getattr(engine, "spec", None)  # the engine's resolved RuntimeSpec (splash/runtime_spec.py)
    if spec is not None:
        cfg, dt = spec.model, dtype_name(spec.dtype)
    else:  # (an engine without one: its rank-0 model says)
        model = local_model(engine)
        cfg, dt = model.cfg, dtype_name(model.dtype)
    theta = getattr(spec, "theta", None)
    if theta is None:
        dev = getattr(getattr(engine.runner, "device", None), "type", "cpu")
        theta, _ = load_or_default_theta(c.theta, world, cfg, dt, dev)
    kv = getattr(spec, "kv_format", None) or (engine.info or {}).get("kv_dtype") or dt  # the pool's format
    dcfg = DepthConfig(c.num_drafts, margin=c.switch_margin, min_dwell=c.min_dwell_steps,
                       draft_layers=cfg.draft_layers)
    return DepthPolicy(AttentionSizes(cfg, dt, kv), theta, dcfg)
