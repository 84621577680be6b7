"""What the engine does when a step fails (`LLMEngine.recovery`, rank 0): the step's own requests end
with an error, a switch that never ran gives its pages back, the failed message's drops are re-sent,
and the books are proved; unsound books (or a switch that ran on the ranks but not on rank 0) end every
request and mark the engine broken, so a server reports unhealthy and exits. docs/runtime.md,
"Events and the books", states the rule beside the others."""

from __future__ import annotations

import logging
from typing import Any

from splash.engine.outputs import RequestOutput
from splash.kv.books import BooksError

log = logging.getLogger("splash.engine")


class StepFailed(RuntimeError):
    """A step failed. The requests it ran were aborted (`failed`: their final snapshots) and the books
    were checked; the other requests go on. `fatal`: the engine cannot step any more (its ranks failed,
    or the books did not balance after the cleanup): every request was aborted."""

    def __init__(self, message: str, failed: list[RequestOutput], fatal: bool) -> None:
        super().__init__(message)
        self.failed = failed
        self.fatal = fatal


class Recovery:
    """The engine's part that proves the books and cleans up after a failed step (`engine.recovery`):
    uses its `scheduler`, `requests`, `switcher`, `runner`, `abort`, `stages` and `check_books`. `NAMES`:
    what the engine answers for it."""

    NAMES = {"failure": "failure", "audit": "audit"}

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.broken: str | None = None  # why no step can run any more (a failed step left it unsound)

    def failure(self) -> BaseException | None:
        """Why no step can run any more (the rank group failed or was shut down, or a failed step left
        the books unsound), or None."""
        if self.broken is not None:
            return RuntimeError(self.broken)
        return self._ranks_failure()

    def _ranks_failure(self) -> BaseException | None:
        probe = getattr(self.engine.runner, "failure", None)
        return probe() if probe is not None else None

    def audit(self, where: str) -> None:
        """With `check_books` on: raise BooksError unless every page and slot is accounted for."""
        if self.engine.check_books and self.broken is None:  # (a broken engine was told already)
            errs = self.engine.scheduler.book_errors()
            if errs:
                self.broken = f"KV books do not balance after {where}: " + "; ".join(errs)
                raise BooksError(self.broken)

    def recover(self, st: Any, err: Exception) -> Exception:
        """After a failed step: give back a switch that never ran, abort the step's requests (all of
        them if the step never got planned), tell the ranks again to forget what the failed message
        may not have carried, and prove the books. Unsound books or failed ranks: abort everything and
        mark the engine broken (no later step runs; a server then reports unhealthy and exits). Returns
        what to raise: StepFailed, or the rank group's own error once it has failed."""
        why = f"{type(err).__name__}: {err}"
        log.error("step failed: %s", why, exc_info=err)
        unsound, eng = None, self.engine
        if eng.switcher is not None:
            if st is not None and st.executed and eng.switcher.pending is not None:
                unsound = "a switch ran on the ranks but could not be committed on rank 0"
            else:
                eng.switcher.abort_pending()  # (a switch that never ran: its destination pages back)
        sched = eng.scheduler
        sched.finished_by_scheduler.clear()
        if st is not None:
            sched.dropped = [*st.plan.dropped, *sched.dropped]  # (ids the ranks already forgot are skipped)
            rids = list(dict.fromkeys(seq.group.request_id for seq in st.seqs))
        else:
            rids = list(eng.requests)
        failed, errs = self._abort_each(rids)
        if not errs:
            try:
                errs = sched.book_errors()
            except Exception as e:  # noqa: BLE001 - a check that cannot run proves nothing
                errs = [f"the books could not be checked: {type(e).__name__}: {e}"]
        if unsound is not None:
            errs.insert(0, unsound)
        if self._ranks_failure() is not None:  # the rank group failed: its own error says why (and says it
            self._abort_each(list(eng.requests))  # again at every later step)
            return err
        if not errs:
            return StepFailed(f"engine step failed: {why}", failed, fatal=False)
        failed += self._abort_each(list(eng.requests))[0]
        self.broken = f"the engine cannot step after a failed step ({why}): " + "; ".join(errs[:3])
        log.error("%s", self.broken)
        return StepFailed(self.broken, failed, fatal=True)

    def _abort_each(self, rids: list[str]) -> tuple[list[RequestOutput], list[str]]:
        """Abort each request; one whose pages cannot be given back (unsound books) is still ended and
        dropped, and the error said. -> (final snapshots, errors)."""
        outs, errs, eng = [], [], self.engine
        for rid in rids:
            req = eng.requests.get(rid)
            try:
                out = eng.abort(rid)
            except Exception as e:  # noqa: BLE001 - the books are unsound; end the request anyway
                errs.append(f"aborting {rid!r} failed: {type(e).__name__}: {e}")
                eng.requests.pop(rid, None)
                if req is None:
                    continue
                for seq in req.seqs:
                    if not seq.status.done:
                        seq.finish("abort")
                out = eng.stages.snapshot(req, final=True)
            if out is not None:
                outs.append(out)
        return outs, errs

    def abort_all_unchecked(self) -> list[RequestOutput]:
        """Abort every request without proving the books afterwards (cleanup after a failure)."""
        eng = self.engine
        return [o for rid in list(eng.requests) if (o := eng.abort(rid)) is not None]
