"""Prefill/decode disaggregation, the prefill side's stage (`engine.pd.prefill`; splash/engine/stages/pd.py).

A request runs with max_tokens = 1 (the first token drawn here with the request's own parameters, as SGLang
does); when it finishes, before its pages are freed, its KV of every store and its KDA state go to the
decode side's pages and slot: the core's manifest from this side's layout to the decode side's, run by
every rank (splash/engine/pd_ranks.py). With MTP layers the pages are held past the step's draft phase, so
the last chunk's draft KV and the first draft chain travel too. A failed write or an abort fails that
request only; `on_done` gets the first token(s), logprobs, the outcome and the decode group's fill moves.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splash.core.layouts import Layout
from splash.core.pd import Group
from splash.engine.request import Request
from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled
from splash.engine.stages.base import Stage
from splash.kv.allocator import pages_for

log = logging.getLogger("splash.engine")
OnDone = Callable[[dict[str, Any]], None]


@dataclass
class PrefillJob:
    """One prefill request's destinations (one per sequence: the decode side reserved pages for each of
    its n) and outcome, reported once every sequence has ended."""

    dest: dict[str, Any]
    targets: list[dict[str, Any]]  # per sequence: {"pages": [...], "slot": int}
    on_done: OnDone | None
    first: list[Sampled | None]
    ended: list[bool]
    drafts: list[list[int]] = dataclasses.field(default_factory=list)  # per sequence: its first chain (MTP)
    fill: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # per sequence: the decode
    # group's own moves that complete its replicas (the manifest's fill), set when it is sent
    error: str | None = None
    nbytes: int = 0
    secs: float = 0.0


def targets(dest: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Each of a request's n sequences' pages and slot on the decode side (`reserve`'s "seqs" for n > 1;
    the destination's own "pages" and "slot" for n = 1). ValueError if they are not n."""
    seqs = dest.get("seqs")
    if seqs is None:
        seqs = [{k: dest[k] for k in ("pages", "slot", "owner", "table") if k in dest}]
    if not isinstance(seqs, list) or len(seqs) != n:
        raise ValueError(f"the decode side reserved pages for {len(seqs) if isinstance(seqs, list) else '?'} "
                         f"sequences but this request samples n = {n}: the two sides disagree on n")
    return seqs


class PDPrefill(Stage):
    """Prefill side: each sequence's write at `on_finish`, before its pages are freed. The n sequences
    of a request run as a colocated engine runs them (each its own first token, seed + index; with the
    prefix cache on, the prompt's full pages computed once and shared), each written into its own
    destination; `on_done` once, when the last one has ended."""

    def __init__(self, pd: Any) -> None:  # (the engine's PD part, splash/engine/stages/pd.py)
        self.pd = pd
        self.jobs: dict[Request, PrefillJob] = {}
        self.held: dict[Seq, PrefillJob] = {}  # (MTP) finished this step, pages kept for the draft phase

    def on_token(self, seq: Seq, s: Sampled, now: float) -> None:
        job = self.jobs.get(seq.group)
        if job is not None and job.first[seq.index] is None:
            job.first[seq.index] = s

    def on_finish(self, seq: Seq) -> None:
        job = self.jobs.get(seq.group)
        if job is None or job.ended[seq.index]:
            return
        n = len(seq.prompt_token_ids)
        if job.first[seq.index] is None or seq.num_computed < n:
            self.end(job, seq, f"the prefill ended before its prompt was computed ({seq.finish_reason}); "
                               "nothing was sent")
            return
        if job.error is not None:  # (a sibling's write failed: the request fails whole, nothing more sent)
            seq.finish("abort")
            self.end(job, seq, None)
            return
        mtp = self.pd.engine.speculation.mtp
        if mtp is not None:  # (the scheduler frees an empty table; `after_step` sends, then frees it)
            mtp.keep[seq] = (seq.pages, seq.slot, self.pd.engine.config.num_drafts)
            self.held[seq] = job
            seq.pages, seq.slot = [], -1
            return
        self.send(job, seq)

    def after_step(self, st: Any) -> None:
        """(MTP) The draft phase has run: send the held sequences' KV with their draft KV, free them."""
        if not self.held:
            return
        held, self.held = self.held, {}
        mtp = self.pd.engine.speculation.mtp
        for seq, job in held.items():
            seq.pages, seq.slot, _ = mtp.keep.pop(seq)
            job.drafts[seq.index] = mtp.drafts.pop(seq, [])
            try:
                self.send(job, seq)
            finally:
                self.pd.engine.scheduler.free(seq)

    def send(self, job: PrefillJob, seq: Seq) -> None:
        """Write `seq`'s prompt KV (every store) and state into its destination, as the core's manifest
        from this side's layout to the decode side's plans it (each block once over the link); end it."""
        pd = self.pd
        n = len(seq.prompt_token_ids)
        target, pages = job.targets[seq.index], pages_for(n, pd.engine.allocator.page_size)
        try:
            info = job.dest["layout"]
            peers = info.get("ranks") or [info]
            src = pd.ranks.group(seq.owner)
            dst = Group(Layout.named(info.get("layout", "tp")), len(peers), int(target.get("owner", 0)))
            man = pd.ranks.manifest(src, dst, n)
            pd.last_dest = (dst.layout, dst.ranks)  # (what `auto` prices a prefill layout's transfer to)
            table = target.get("table") or [target["pages"]]
            writes = pd.ranks.writes(man.pages, man.states, src, [row[:pages] for row in seq.pages],
                                     seq.slot, dst, [list(row[:pages]) for row in table],
                                     int(target.get("slot", -1)), peers)
            nbytes, secs, pieces, err = pd.ranks.send(writes)
        except Exception as e:  # (a malformed destination: this request only)
            log.exception("the KV write of %s failed", seq.group.request_id)
            nbytes, secs, pieces, err = 0, 0.0, 0, f"the KV write failed: {type(e).__name__}: {e}"
        if err is not None:
            seq.finish("abort")
            self.end(job, seq, err)
            return
        pd.sent(nbytes, secs, pieces)
        job.nbytes += nbytes
        job.secs += secs
        job.fill[seq.index] = {"pages": [[m.page, m.src, m.dst] for m in man.fill_pages],
                               "states": [[m.store, m.h0, m.h1, m.src, m.dst] for m in man.fill_states]}
        self.end(job, seq, None)

    def end(self, job: PrefillJob, seq: Seq, error: str | None) -> None:
        """`seq` has ended (sent, failed or dropped); the request's result once all have."""
        job.ended[seq.index] = True
        if error is not None and job.error is None:
            job.error = error
            self.pd.failures += 1
        if all(job.ended):
            self.report(job, seq.group)

    def report(self, job: PrefillJob, req: Request) -> None:
        firsts = [None if s is None else s.token_id for s in job.first]
        lps = [None if s is None else s.logprobs for s in job.first]
        table = self.pd.prompt_table(req)
        result = {"request_id": req.request_id, "first_token": firsts[0], "logprobs": lps[0],
                  "first_tokens": firsts, "first_logprobs": lps, "drafts": job.drafts,
                  "error": job.error, "bytes": job.nbytes, "seconds": job.secs, "fill": job.fill,
                  "prompt_logprobs": None if table is None else list(table.values)}
        if job.on_done is not None:
            try:
                job.on_done(result)
            except Exception:  # (the caller's callback must not fail the step of other requests)
                log.exception("the prefill callback of %s failed", req.request_id)

    def on_drop(self, seq: Seq) -> None:
        if self.held.pop(seq, None) is not None:  # (a failed step before its draft phase: free the pages)
            seq.pages, seq.slot, _ = self.pd.engine.speculation.mtp.keep.pop(seq)
            self.pd.engine.scheduler.free(seq)
        job = self.jobs.get(seq.group)
        if job is None:
            return
        if not job.ended[seq.index]:  # aborted (by the caller, or a failed step)
            self.end(job, seq, "the prefill request was aborted before its KV was sent")
        if all(job.ended):
            del self.jobs[seq.group]
