"""Rank 0's step clock for `--layout auto`: time steps, price them, feed the correction and the guard.

The analytical core keeps the learning (`splash.core.correction.StepCorrection`: measured/predicted per
layout and kind of step; `splash.core.regret.RegretGuard`: was the last switch worth it); this module is
the runtime's side. `begin` (just before the step runs) notes the layout and the step's batch; `end`
(right after) reads the clock - `runner.execute`'s wall time, as `splash calibrate` times a step, after
a CUDA synchronize - prices the step in the layout that ran it (Eq 10 on the prior theta, cached while
the batch keeps its shape) and reports both. A step that switched layouts is not a sample (it also moved
state); outside a guard's watch, a kind of step the layout has measured enough is sampled once in STRIDE
steps (the rest cost the clock nothing). During a probation the guard also gets the counterfactual: what
the source layout's own recent pace on steps of the same kind (batch-size bucket, mix) says this batch
would have taken there (with that pace's standard error); a step of a kind the source has not run
recently is not compared. After a switch back, the guard's recheck gets the reverse: what the layout
given up showed on such steps.
`timer` replaces the clock with a synthetic step-time source (tests: deterministic, no wall clock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from splash.core.correction import CorrectionConfig, Estimate, StepCorrection, StepKey
from splash.core.costmodel import step_cost
from splash.core.layouts import Layout
from splash.core.regret import RegretGuard, Verdict, median_se

log = logging.getLogger("splash.switch")

REPRICE = 8  # steps a cached prediction of an unchanged batch shape is reused (contexts grow slowly)
SAMPLE_GAP = 8  # a step whose shape changed is a sample only this many steps after the last pricing:
#                 building a Batch costs ~0.2 ms, and prefill chunks change shape every step
STRIDE = 4  # outside a guard's watch, a kind of step the layout has measured (min_samples fresh ratios)
#             is sampled once in this many steps: on the 2-core VM a sample (clock, shape, price,
#             record) costs ~40 us right after a step, and sampling every step cost ~0.25% of a
#             rollout; the median over the window then spans 64 steps (the machine drifts over hundreds)
Timer = Callable[[str, StepKey, float], float]  # (layout, key, predicted s) -> "measured" s


class StepFeedback:
    def __init__(self, sizes: Any, theta: Any, page_size: int | None, layouts: Sequence[str], margin: float,
                 batch_of: Callable[[Any, list[Any]], Any], sync: Callable[[], None] | None = None,
                 config: CorrectionConfig = CorrectionConfig()) -> None:
        self.sizes, self.theta, self.page_size = sizes, theta, page_size
        self.layouts = tuple(layouts)
        self.batch_of = batch_of  # (plan, live) -> costmodel.Batch, the controller's view of a step
        self.sync = sync
        self.correction = StepCorrection(config)
        self.guard = RegretGuard(margin=margin)
        self.timer: Timer | None = None
        self._step: tuple[int, str, StepKey, Any, list[Any], Any] | None = None  # the step under the clock
        self._t0 = 0.0
        self._batch: tuple[Any, int, Any] | None = None  # (shape signature, step, Batch)
        self._prices: dict[str, float] = {}  # layout -> prediction for the cached batch
        self._shape_of: tuple[Any, tuple[tuple[int, int], ...]] = (None, ())  # (plan, its shape)
        self._sampled = -STRIDE  # the last step sampled

    # ---- the clock -----------------------------------------------------------------------------------
    def begin(self, plan: Any, live: list[Any], layout: str, switching: bool) -> None:
        """The step `plan` is about to run in `layout` (`switching`: it also switches: no sample)."""
        watched = self.guard.watching()  # (nothing moves the guard before `end` reads it)
        if switching or not plan.seqs:
            self._step = None
            return
        key = self.key(plan)
        if watched is None and (self._thinned(plan.step, layout, key) or self._unsampled(plan)):
            self._step = None
            return
        self._step = (plan.step, layout, key, plan, live, watched)
        self._t0 = time.perf_counter()

    def _thinned(self, step: int, layout: str, key: StepKey) -> bool:
        """A kind of step this layout has measured enough is sampled once in STRIDE steps (the guard
        watches every step; a kind not yet measured, every step its shape may be priced: a verdict
        waits on it)."""
        return step - self._sampled < STRIDE and self.correction.settled(layout, key, step)

    def _unsampled(self, plan: Any) -> bool:
        """A new shape right after the last pricing is not a sample (unless the guard watches: it needs
        them all): in a prefill-heavy phase the shape changes every step, and such a step costs no more."""
        c = self._batch
        return c is not None and plan.step - c[1] < SAMPLE_GAP and not self.priced(plan)

    @staticmethod
    def key(plan: Any) -> StepKey:
        """The plan's kind of step (every slice of a plan has at least one row)."""
        return StepKey.sized(len(plan.seqs), plan.num_rows)

    def end(self) -> Verdict | None:
        """The step ran: record it; a guard Verdict when this step ends a probation."""
        if self._step is None:
            return None
        if self.sync is not None:
            self.sync()
        wall = time.perf_counter() - self._t0
        step, layout, key, plan, live, watched = self._step
        self._step = None
        predicted = self.price(layout, plan, live)
        measured = self.timer(layout, key, predicted) if self.timer is not None else wall
        self.correction.observe(layout, key, predicted, measured, step)
        self._sampled = step
        if watched is None:
            return None
        running, other = watched
        counter, counter_se = None, 0.0
        if layout == running:  # comparable: the other layout measured on this very kind of step
            ref = self.correction.measured(other, key, step)
            if ref is not None:
                counter = ref.factor * self.price(other, plan, live)
                counter_se = median_se(self.correction.fresh(other, key, step)) / ref.factor
        return self.guard.observe(step, layout, key.bucket, measured, counter, counter_se)

    # ---- prices ----------------------------------------------------------------------------------------
    def _shape(self, plan: Any) -> tuple[tuple[int, int], ...]:
        """The step's shape (requests and their rows), made once per plan: asked 2-3 times a step."""
        if self._shape_of[0] is not plan:
            self._shape_of = (plan, tuple((s.req_id, s.num_new) for s in plan.seqs))
        return self._shape_of[1]

    def priced(self, plan: Any) -> bool:
        """Whether the cached Batch is this step's (same shape, recent enough)."""
        c = self._batch
        return c is not None and plan.step - c[1] < REPRICE and c[0] == self._shape(plan)

    def batch(self, plan: Any, live: list[Any]) -> Any:
        """The step's Batch, reused while its shape (requests and their rows) holds for REPRICE steps."""
        if not self.priced(plan):
            self._batch = (self._shape(plan), plan.step, self.batch_of(plan, live))
            self._prices = {}
        return self._batch[2]

    def price(self, layout: str, plan: Any, live: list[Any]) -> float:
        """Eq 10 on the prior theta for this step in `layout` (cached with the batch)."""
        b = self.batch(plan, live)
        if layout not in self._prices:
            self._prices[layout] = step_cost(Layout.parse(layout), self.sizes, b, self.theta,
                                             self.page_size).total
        return self._prices[layout]

    def note_prices(self, plan: Any, live: list[Any], prices: dict[str, float]) -> None:
        """Predictions the Policy just made for this step's batch: kept, so the log does not redo them."""
        self.batch(plan, live)
        for lay, t in prices.items():
            self._prices.setdefault(lay, t)

    # ---- what the policy and the log see -------------------------------------------------------------
    def estimates(self, plan: Any, step: int) -> tuple[StepKey, dict[str, Estimate]]:
        key = self.key(plan)
        return key, self.correction.estimates(self.layouts, key, step)

    def blocked(self, key: StepKey, step: int) -> list[str]:
        """Layouts the guard keeps out of this kind of step now (after a switch back)."""
        return [lay for lay in self.layouts if self.guard.blocked(lay, key.bucket, step)]
