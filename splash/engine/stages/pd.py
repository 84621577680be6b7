"""Prefill/decode disaggregation in the engine (SGLang's `--disaggregation-mode prefill|decode`).

Decode side (`PD.reserve`, `arrived`, `fail`): a request whose prompt another engine computes is made
like any other (`LLMEngine.new_request`) but *parked* (`Scheduler.reserve`): it holds pages for its prompt
(and a KDA slot), counted by the books, and no step runs it. When the prefill engine has written the
KV into those pages and sent the first token, `arrived` moves it into the running batch with its prompt
computed and commits that token through the engine's own commit path (stop rules, detokenizer,
logprobs, grammar), so from there it decodes as if it had been prefilled here. `fail` (or an abort)
frees what it held.

Prefill side (`PD.add_prefill`, its stage in splash/engine/stages/pd_prefill.py): the request runs with
max_tokens = 1 (the first token drawn here with the request's own parameters, as SGLang does); when it
finishes, before its pages are freed, its KV of every store and its KDA state go to the decode side's
pages and slot, as the core's manifest from this side's layout to the decode side's plans it, every rank
writing its share (splash/engine/pd_ranks.py), and `on_done` gets the first token, its logprobs and the
outcome. A failed write or an abort fails that request only. With MTP layers
(`--speculative-algorithm MTP`) the pages are held past the step's draft phase (`MtpDrafter.keep`),
which writes the last chunk's draft KV (the `mtp_*` stores, sent with the rest) and chains the drafts
the decode side's first step verifies, as a colocated engine's first decode step does (`arrived`'s
`drafts`).

A request with n > 1 (an RL group) reserves pages for each of its n sequences; the prefill side runs
its n sequences as a colocated engine would (the prompt's full pages computed once when the prefix cache
is on; each sequence's first token drawn with its own seed) and writes each into its own pages, so
sequence i on the decode side continues from first token i.

Each side runs any layout at its own T and switches live (issue 47): a decode side defers a switch while
requests wait for their KV. Per-request state lives in the two stages' tables, not on `Sequence`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from splash.core.pd import PageMove, StateMove
from splash.engine.outputs import RequestOutput
from splash.engine.pd_ranks import PDRanks
from splash.engine.request import Request
from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled
from splash.engine.sampling import SamplingParams
from splash.engine.stages.base import Stage
from splash.engine.stages.pd_prefill import OnDone, PDPrefill, PrefillJob, targets
from splash.kv.allocator import pages_for

log = logging.getLogger("splash.engine")
# Seconds the pages of a request aborted while parked stay held (the prefill side may still be writing
# into them; reused at once, a late write would land in another request's KV).
DRAIN_S = 30.0


class PDNoRoom(RuntimeError):
    """The decode engine has no room for the request's prompt now (pages, a state slot or the headroom
    kept for running requests); it may have after later steps: try again."""


class PDDecode(Stage):
    """Decode side: the parked requests (reserved, their KV not yet arrived: each of its n sequences
    holds its own pages); the PD counters."""

    def __init__(self, pd: PD) -> None:
        self.pd = pd
        self.parked: dict[str, list[Seq]] = {}

    def stats(self) -> dict[str, Any]:
        return self.pd.stats()

    def on_drop(self, seq: Seq) -> None:
        seqs = self.parked.get(seq.group.request_id)
        if seqs is not None and any(s is seq for s in seqs):
            del self.parked[seq.group.request_id]


class PD:
    """The engine's PD part (`engine.pd`): its two stages and the calls the server makes (engine thread)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.prefill = PDPrefill(self)
        self.decode = PDDecode(self)
        self.stages = [self.prefill, self.decode]
        self.ranks = PDRanks(engine)
        self.last_dest: tuple[Any, int] | None = None  # prefill: the decode group last sent to (layout, T)
        self.bytes_total = 0  # sent (prefill side) and received (decode side), over the link
        self.fill_bytes_total = 0  # moved inside this (decode) group to complete replicas
        self.seconds_total = 0.0
        self.pieces_total = 0  # (prefill side) the (address, length) entries of its batch writes
        self.transfers = 0
        self.failures = 0
        engine.scheduler.drain_s = DRAIN_S
        if getattr(engine.config, "disaggregation_mode", "null") not in (None, "null"):
            self.ranks.start()  # every rank's transfer engine with the engine, so a bad install fails now

    # ---- the transfer engines -------------------------------------------------------------------
    def layout_info(self) -> dict[str, Any]:
        """What the handshake sends the peer: identity, memory of every rank, the live layout and size."""
        return self.ranks.layout_info()

    def check_peer(self, info: dict[str, Any]) -> None:
        """Raise ValueError naming the first difference between this engine and the peer's `info`."""
        self.ranks.local().check_peer(info)

    def sent(self, nbytes: int, secs: float, pieces: int = 0) -> None:
        self.bytes_total += nbytes
        self.seconds_total += secs
        self.pieces_total += pieces
        self.transfers += 1

    # ---- decode side ----------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        """Park a request whose KV the prefill engine will write: pages (and a slot) for each of its n
        sequences; -> its destination (JSON-able: the prefill side's `add_prefill` takes it; for n > 1
        "seqs" lists each sequence's pages and slot). ValueError: it can never run here; PDNoRoom: not
        now (nothing is held then)."""
        eng = self.engine
        if eng.rl.kv_released:  # (as a colocated engine's requests wait for the resume, so does this one)
            raise PDNoRoom("this decode server's KV memory is released (release_memory_occupation); no "
                           "pages until it is resumed")
        switcher = getattr(eng, "switcher", None)
        if switcher is not None and switcher.deferred is not None:
            raise PDNoRoom(f"a layout switch to {switcher.deferred} waits for the requests whose KV is on "
                           "its way; new ones are reserved after it")
        info = self.layout_info()
        req = eng.new_request(request_id, params=params, prompt_token_ids=prompt_token_ids)
        held: list[Seq] = []
        try:
            for seq in req.seqs:  # (each one's headroom counts the siblings parked before it)
                if not eng.scheduler.reserve(seq, self._headroom(seq)):
                    break
                held.append(seq)
        finally:
            if len(held) < len(req.seqs):  # (nothing stays taken: the request is forgotten as if never made)
                for seq in held:
                    eng.scheduler.unpark(seq)
                    eng.scheduler.free(seq)
                eng.requests.pop(request_id, None)
                eng.stages.drop(req)
        if len(held) < len(req.seqs):
            raise PDNoRoom(f"no room for {len(req.seqs)} x a prompt of {len(req.prompt_token_ids)} tokens "
                           f"now (free pages per rank {eng.allocator.num_free}); retry after some steps")
        self.decode.parked[request_id] = list(req.seqs)
        eng.audit(f"pd reserve {request_id}")
        first = req.seqs[0]
        dest = {"request_id": request_id, "session_id": info["session_id"], "pages": list(first.pages[0]),
                "slot": first.slot, "owner": first.owner, "table": [list(r) for r in first.pages],
                "num_tokens": len(req.prompt_token_ids), "layout": info}
        if len(req.seqs) > 1:
            dest["seqs"] = [{"pages": list(s.pages[0]), "slot": s.slot, "owner": s.owner,
                             "table": [list(r) for r in s.pages]} for s in req.seqs]
        return dest

    def _headroom(self, new: Seq) -> int:
        """Pages kept free for growth (SGLang's --num-reserved-decode-tokens): per running or parked
        sequence and for `new`, that many tokens' pages, or fewer if it will need fewer."""
        sch, P = self.engine.scheduler, self.engine.allocator.page_size
        per = pages_for(int(getattr(self.engine.config, "num_reserved_decode_tokens", 0) or 0), P)
        out = 0
        for s in (*sch.running, *sch.parked, new):
            held = len(s.pages[0]) if s.pages else pages_for(len(s.prompt_token_ids), P)
            out += min(per, max(0, sch.projected_pages(s) - held))
        return out

    def arrived(self, request_id: str, first_token: int | list[int],
                first_logprobs: dict[Any, float] | list[dict[Any, float] | None] | None = None,
                prompt_logprobs: list[dict[Any, float] | None] | None = None,
                drafts: list[list[int]] | None = None, nbytes: int | None = None,
                fill: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """The KV of a parked request is in its pages: it joins the batch with `first_token` committed
        (n > 1: a list, sequence i continues from token i, with logprobs i; `prompt_logprobs`: what the
        prefill side computed, if the request asked; `drafts`: the prefill's result["drafts"], one MTP
        chain per sequence, which its first step verifies; `nbytes`: the bytes the prefill wrote into
        this side, result["bytes"]; `fill`: result["fill"], per sequence the moves inside this group
        that complete its replicas, run here first). -> its snapshot (final if those tokens ended it).
        Unknown (aborted meanwhile): []. A failed fill fails the request (RuntimeError)."""
        eng = self.engine
        seqs = self.decode.parked.get(request_id)
        if seqs is None:
            return []
        firsts = first_token if isinstance(first_token, list) else [first_token]
        lps = first_logprobs if isinstance(first_logprobs, list) else [first_logprobs] * len(firsts)
        if len(firsts) != len(seqs) or len(lps) != len(seqs):  # (before anything changes: it stays parked)
            raise ValueError(f"{len(firsts)} first tokens for {len(seqs)} sequences")
        if prompt_logprobs is not None:
            self._prompt_logprobs(seqs[0], prompt_logprobs)
        if fill and any(f.get("pages") or f.get("states") for f in fill):
            self._fill(request_id, seqs, fill)
        del self.decode.parked[request_id]
        changed: dict[str, Request] = {}
        if nbytes is None:  # (a caller that does not pass the prefill's count: one rank's whole request)
            n_pages = pages_for(len(seqs[0].prompt_token_ids), eng.allocator.page_size)
            nbytes = sum(self.ranks.local().request_bytes(n_pages, s.slot >= 0) for s in seqs)
        self.sent(int(nbytes), 0.0)
        self.transfers += len(seqs) - 1
        for seq, tok, d in zip(seqs, firsts, lps):
            eng.scheduler.admit_computed(seq)
            self._skip_draw(seq)
            lp = None if d is None else {int(k): float(v) for k, v in d.items()}
            eng.commit(seq, Sampled(int(tok), lp), time.time())
            changed[request_id] = seq.group
            if seq.status.done:
                eng._seq_finished(seq, changed)
            elif seq.index < len(drafts or ()) and eng.speculation.mtp is not None:  # (cut to our depth)
                chain = [int(t) for t in drafts[seq.index]][:eng.speculation.draft_room(seq)]
                if chain:
                    eng.speculation.mtp.drafts[seq] = chain
        outs = eng._collect(changed)
        eng.audit(f"pd arrived {request_id}")
        return outs

    def _fill(self, request_id: str, seqs: list[Seq], fill: list[dict[str, Any]]) -> None:
        """Complete the replicas this group's layout keeps (TP's pages, CP's KDA state) from the copy
        each block arrived as: the manifest's fill moves, rank to rank inside this group."""
        peers = self.layout_info()["ranks"]
        for seq, f in zip(seqs, fill):
            if not (f.get("pages") or f.get("states")):
                continue
            me = self.ranks.group(seq.owner)
            pages = tuple(PageMove(int(j), int(a), int(b)) for j, a, b in f.get("pages", ()))
            states = tuple(StateMove(str(st), int(h0), int(h1), int(a), int(b))
                           for st, h0, h1, a, b in f.get("states", ()))
            writes = self.ranks.writes(pages, states, me, seq.pages, seq.slot, me, seq.pages, seq.slot, peers)
            nbytes, _, _, err = self.ranks.send(writes)
            if err is not None:
                self.fail(request_id, f"completing the KV replicas in this group failed: {err}")
                raise RuntimeError(f"request {request_id}: completing the KV replicas failed: {err}")
            self.fill_bytes_total += nbytes

    def _prompt_logprobs(self, seq: Seq, values: list[dict[Any, float] | None]) -> None:
        """Fill the request's prompt logprobs (PromptLogprobsStage's table) with the prefill side's."""
        n = len(seq.prompt_token_ids)
        if len(values) != n:
            raise ValueError(f"{len(values)} prompt logprobs for a prompt of {n} tokens")
        rec = self.prompt_table(seq.group)
        if rec is not None:
            rec.values = [None if d is None else {int(k): float(v) for k, v in d.items()} for d in values]
            rec.next = n

    def prompt_table(self, req: Request) -> Any:
        """`req`'s entry in the prompt-logprobs stage (None: it did not ask)."""
        from splash.engine.stages.prompt_logprobs import PromptLogprobsStage

        for st in self.engine.stages.stages:
            if isinstance(st, PromptLogprobsStage):
                return st.table.get(req)
        return None

    def _skip_draw(self, seq: Seq) -> None:
        """A seeded random draw made the first token on the prefill side: advance this side's generator
        past that draw (the sampler's one exponential noise row over the vocabulary), so the next draws
        are the colocated engine's."""
        if seq.generator is None or seq.params.greedy:
            return
        eng = self.engine
        dtype = eng.spec.dtype  # (the logits' dtype: the runner samples half-precision models' in float32)
        dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        noise = torch.empty(eng.vocab_size, dtype=dtype, device=eng.runner.device)
        noise.exponential_(generator=seq.generator)

    def fail(self, request_id: str, reason: str) -> RequestOutput | None:
        """The KV of a parked (or running) request will not come (the prefill side failed, refused it, or
        is gone: nothing more will be written): free what it holds now, end it (abort)."""
        self.failures += 1
        for seq in self.decode.parked.pop(request_id, ()):
            self.engine.scheduler.unpark(seq)
        return self.engine.abort(request_id)

    # ---- prefill side ---------------------------------------------------------------------------
    def add_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    dest: dict[str, Any], on_done: OnDone | None = None) -> Request:
        """Run a prompt whose decoding happens on the engine of `dest` (its `reserve`): max_tokens 1 for
        each of its n sequences, each one's KV then written into its own destination; `on_done(result)`
        once, on the engine thread (first token(s), logprobs, error or None, bytes, seconds). ValueError:
        the peer differs (named) or the request is unfit (prompt or n not the reserved ones)."""
        self.check_peer(dest["layout"])
        need = pages_for(len(prompt_token_ids), self.engine.allocator.page_size)
        where = targets(dest, params.n)
        if dest.get("num_tokens") != len(prompt_token_ids) or any(len(t.get("pages", ())) < need
                                                                   for t in where):
            raise ValueError(f"the decode side reserved {len(dest.get('pages', ()))} pages for "
                             f"{dest.get('num_tokens')} prompt tokens but this prompt has "
                             f"{len(prompt_token_ids)}: the two sides disagree on the prompt (tokenizer or "
                             "chat template)")
        one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        req = self.engine.add_request(request_id, params=one, prompt_token_ids=prompt_token_ids)
        n = len(req.seqs)
        self.prefill.jobs[req] = PrefillJob(dest, where, on_done, [None] * n, [False] * n,
                                            [[] for _ in range(n)], [{} for _ in range(n)])
        return req

    def stats(self) -> dict[str, Any]:
        return {"kv_transfer_bytes_total": self.bytes_total, "kv_transfer_seconds_total": self.seconds_total,
                "kv_fill_bytes_total": self.fill_bytes_total, "kv_transfer_pieces_total": self.pieces_total,
                "kv_transfers_total": self.transfers, "kv_transfer_failures_total": self.failures,
                "pd_waiting_for_kv": len(self.decode.parked), "pd_prefill_inflight": len(self.prefill.jobs),
                "pd_draining": len(self.engine.scheduler.draining)}

    def release(self) -> None:
        """The KV memory is about to be freed (`release_memory_occupation`): no write may land in it.
        Its registration goes first on every rank (a prefill's write then fails at once with Mooncake's
        error instead of landing in freed memory; a new transfer engine, a new session, on the next use:
        Mooncake's segment does not take memory registered again after this), then every request still
        waiting for its KV fails, and the pages of aborted ones held against a late write are freed (no
        write can land there any more)."""
        self.ranks.close()
        for rid in list(self.decode.parked):
            self.fail(rid, "the decode server released its KV memory (release_memory_occupation) before "
                           "the prompt's KV arrived")
        self.engine.scheduler.expire(float("inf"))

    def close(self) -> None:
        try:
            self.ranks.close()
        except Exception:  # noqa: BLE001 - closing (a failed rank group has nothing left to close)
            log.debug("closing the transfer engines failed", exc_info=True)
