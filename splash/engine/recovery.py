"""What the engine does when a step fails (mixed into `LLMEngine`, rank 0): the step's own requests end
with an error, a switch that never ran gives its pages back, the failed message's drops are re-sent,
and the books are proved; unsound books (or a switch that ran on the ranks but not on rank 0) end every
request and mark the engine broken, so a server reports unhealthy and exits. docs/runtime.md,
"Events and the books", states the rule beside the others."""

from __future__ import annotations

import logging
from typing import Any

from splash.engine.outputs import RequestOutput

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
    """Mixin of LLMEngine: needs `scheduler`, `requests`, `switcher`, `abort`, `_broken` and
    `_ranks_failure`."""

    scheduler: Any
    requests: dict[str, Any]
    switcher: Any
    _broken: str | None

    def abort(self, request_id: str) -> RequestOutput | None: ...  # LLMEngine's

    def _ranks_failure(self) -> BaseException | None: ...  # LLMEngine's

    def _recover(self, st: Any, err: Exception) -> Exception:
        """After a failed step: give back a switch that never ran, abort the step's requests (all of
        them if the step never got planned), tell the ranks again to forget what the failed message
        may not have carried, and prove the books. Unsound books or failed ranks: abort everything and
        mark the engine broken (no later step runs; a server then reports unhealthy and exits). Returns
        what to raise: StepFailed, or the rank group's own error once it has failed."""
        why = f"{type(err).__name__}: {err}"
        log.error("step failed: %s", why, exc_info=err)
        unsound = None
        if self.switcher is not None:
            if st is not None and st.executed and self.switcher.pending is not None:
                unsound = "a switch ran on the ranks but could not be committed on rank 0"
            else:
                self.switcher.abort_pending()  # (a switch that never ran: its destination pages back)
        sched = self.scheduler
        sched.finished_by_scheduler.clear()
        if st is not None:
            sched.dropped = [*st.plan.dropped, *sched.dropped]  # (ids the ranks already forgot are skipped)
            rids = list(dict.fromkeys(seq.group.request_id for seq in st.seqs))
        else:
            rids = list(self.requests)
        failed, errs = self._abort_each(rids)
        if not errs:
            try:
                errs = sched.book_errors()
            except Exception as e:  # noqa: BLE001 - a check that cannot run proves nothing
                errs = [f"the books could not be checked: {type(e).__name__}: {e}"]
        if unsound is not None:
            errs.insert(0, unsound)
        if self._ranks_failure() is not None:  # the rank group failed: its own error says why (and says it
            self._abort_each(list(self.requests))  # again at every later step)
            return err
        if not errs:
            return StepFailed(f"engine step failed: {why}", failed, fatal=False)
        failed += self._abort_each(list(self.requests))[0]
        self._broken = f"the engine cannot step after a failed step ({why}): " + "; ".join(errs[:3])
        log.error("%s", self._broken)
        return StepFailed(self._broken, failed, fatal=True)

    def _abort_each(self, rids: list[str]) -> tuple[list[RequestOutput], list[str]]:
        """Abort each request; one whose pages cannot be given back (unsound books) is still ended and
        dropped, and the error said. -> (final snapshots, errors)."""
        outs, errs = [], []
        for rid in rids:
            req = self.requests.get(rid)
            try:
                out = self.abort(rid)
            except Exception as e:  # noqa: BLE001 - the books are unsound; end the request anyway
                errs.append(f"aborting {rid!r} failed: {type(e).__name__}: {e}")
                self.requests.pop(rid, None)
                if req is None:
                    continue
                for seq in req.seqs:
                    if not seq.status.done:
                        seq.finish("abort")
                out = req.output()
            if out is not None:
                outs.append(out)
        return outs, errs

    def abort_all_unchecked(self) -> list[RequestOutput]:
        """Abort every request without proving the books afterwards (cleanup after a failure)."""
        return [o for rid in list(self.requests) if (o := self.abort(rid)) is not None]
