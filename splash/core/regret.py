"""The regret guard: after a voluntary switch, check that the destination really runs faster.

The policy switches on predictions; a prediction can be wrong for this machine today. So after a
switch src -> dst chosen by the policy, the guard watches dst's next `window` measured steps (after
`settle` steps that may still pay for the switch) and compares each with what src would have taken
on the same batch: src's own recent pace on comparable steps (the same batch-size bucket and mix;
the runtime computes it as src's measured ratio there x src's prediction for this batch, see
`correction.StepCorrection.measured`). A probation that finds fewer than `min_samples` comparable
steps within `patience` steps keeps the switch. If the median of measured(dst) / counterfactual(src) exceeds
1 + margin by more than `z` standard errors of that median, the switch made things slower: the guard
asks to switch back and blocks dst in the buckets it was tried on for `block_steps` steps.
Why the standard error: one CPU step varies by 20-50% (IQR / median) on a shared machine, so the
median of 8 regrets is itself uncertain by ~10-20%, as much as the differences the guard judges; a
plain threshold switched back good switches on noise (and the block then kept the faster layout out
for the rest of a run). A median at or under 1 + margin keeps the switch at once; one above it but
within the noise extends the probation to `max_samples` comparable steps (the standard error shrinks
as 1/sqrt(n)) and is then judged by the same rule. The standard error also counts the source's
reference pace (the median of its last few steps, whose error every regret shares). A slowdown the
guard cannot prove is still seen by the policy, which prices both layouts at their measured pace and
moves back past its own margin.
Hysteresis: a switch back is not itself watched, and a blocked layout is no candidate, so the pair
cannot flap. But the source's pace the guard compared with is from *before* the switch: when the
machine itself slows down just then (another tenant, a host's frequency drop), the destination looks
slower than it is. So a switch back is rechecked: the source's next `window` comparable steps are
compared with the pace the destination showed; if the source, back again, runs no faster than the
destination did (median ratio at or over 1), the slowdown was the machine's, not the layout's, and
the block is lifted (once per pair of layouts: the policy may try the destination again, at its
measured pace). Pure and step-clocked: deterministic.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from splash.core.model_config import ConfigError


@dataclass
class Probation:
    """A switch under watch: the destination's regrets so far."""

    src: str
    dst: str
    step: int  # the step that switched
    regrets: list[float] = field(default_factory=list)
    buckets: set[int] = field(default_factory=set)
    seen: int = 0  # steps observed in dst (comparable or not)
    ref_se: list[float] = field(default_factory=list)  # relative standard error of each counterfactual


@dataclass
class Recheck:
    """A switch back under watch: does the source, run again, beat the pace the destination showed?"""

    back: str  # the layout switched back to (the probation's source)
    tried: str  # the layout given up and blocked (the probation's destination)
    step: int  # the step whose verdict switched back
    buckets: set[int]
    ratios: list[float] = field(default_factory=list)  # measured(back) / counterfactual(tried)
    seen: int = 0


@dataclass(frozen=True)
class Verdict:
    """The end of a probation: keep the switch, or go back."""

    src: str
    dst: str
    switch_back: bool
    regret: float  # median measured(dst) / counterfactual(src); nan when nothing was comparable
    samples: int
    se: float  # standard error of that median (from the regrets' interquartile range); nan: no samples
    step: int
    reason: str
    unblocked: bool = False  # a recheck's verdict: the switch back followed the machine; block lifted

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "switch_back": self.switch_back,
                "unblocked": self.unblocked,
                "regret": None if math.isnan(self.regret) else round(self.regret, 4), "samples": self.samples,
                "se": None if math.isnan(self.se) else round(self.se, 4), "step": self.step,
                "reason": self.reason}


def median_se(values: list[float]) -> float:
    """Standard error of the median of `values` (normal approximation: 1.2533 sigma / sqrt(n), sigma
    from the interquartile range, as `calibration.measure.Timing.se`): robust to the odd stalled step."""
    n = len(values)
    if n < 2:
        return float("nan") if n == 0 else 0.0
    # numpy's default (linear) percentiles; np.percentile's first call imports numpy.ma (~16 ms, mid-run)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return float(1.2533 * (q3 - q1) / 1.349 / n ** 0.5)


class RegretGuard:
    def __init__(self, margin: float = 0.05, window: int = 8, settle: int = 1, block_steps: int = 2000,
                 patience: int = 64, min_samples: int = 3, z: float = 2.0, max_samples: int = 32) -> None:
        if not 0 <= margin < 1:
            raise ConfigError(f"regret guard: margin must be in [0, 1), got {margin}")
        if window < 1 or settle < 0 or block_steps < 0 or patience < window or z < 0:
            raise ConfigError("regret guard: need window >= 1, settle >= 0, block_steps >= 0, "
                              "patience >= window, z >= 0")
        self.margin, self.window, self.settle = margin, window, settle
        self.block_steps, self.patience = block_steps, patience
        self.min_samples = min_samples  # fewest comparable steps a switch back rests on (<= window)
        self.z = z  # standard errors of the median regret a switch back must clear beyond the margin
        self.max_samples = max_samples  # comparable steps an inconclusive probation may extend to
        self.probation: Probation | None = None
        self.recheck: Recheck | None = None
        self.rechecked: set[tuple[str, str]] = set()  # (tried, back) pairs whose block was lifted once
        self.blocks: dict[tuple[str, int], int] = {}  # (layout, bucket) -> blocked until this step
        self.verdicts: list[Verdict] = []
        self.switch_backs: dict[tuple[str, str], int] = {}

    def switched(self, step: int, src: str, dst: str, voluntary: bool) -> None:
        """A switch committed at `step`. Only the policy's own (voluntary) switches are watched; any
        other switch (forced, requested, a switch back) ends a probation unjudged; any but the switch back
        a recheck waits for ends that recheck."""
        self.probation = Probation(src, dst, int(step)) if voluntary and src != dst else None
        r = self.recheck
        if r is not None and (voluntary or (src, dst) != (r.tried, r.back)):
            self.recheck = None

    def watching(self) -> tuple[str, str] | None:
        """(the layout under watch, the one its steps are compared with), or None: a probation compares
        the destination with the source; a recheck, the source run again with the destination."""
        if self.probation is not None:
            return self.probation.dst, self.probation.src
        if self.recheck is not None:
            return self.recheck.back, self.recheck.tried
        return None

    def observe(self, step: int, layout: str, bucket: int, measured_s: float,
                counterfactual_s: float | None, counterfactual_se: float = 0.0) -> Verdict | None:
        """One measured step; a Verdict when this step ends a probation. `counterfactual_se`: the
        relative standard error of the source's pace the counterfactual rests on (a median of few
        steps is uncertain too, and every regret shares that error)."""
        p = self.probation
        if p is None:
            return self._recheck(step, layout, bucket, measured_s, counterfactual_s)
        if layout != p.dst:  # the layout changed under the guard: nothing left to judge
            self.probation = None
            return None
        p.seen += 1
        if p.seen <= self.settle:
            return None
        if counterfactual_s is not None and counterfactual_s > 0 and measured_s > 0:
            p.regrets.append(measured_s / counterfactual_s)
            p.ref_se.append(max(0.0, float(counterfactual_se)))
            p.buckets.add(int(bucket))
        n = len(p.regrets)
        if n >= self.window and (n >= max(self.window, self.max_samples) or self._conclusive()):
            return self._judge(step)
        if p.seen >= self.patience + self.settle:  # never comparable (or conclusive) enough: judge now
            return self._judge(step)
        return None

    def _recheck(self, step: int, layout: str, bucket: int, measured_s: float,
                 counterfactual_s: float | None) -> Verdict | None:
        """One step of the source after a switch back, against the destination's measured pace."""
        r = self.recheck
        if r is None:
            return None
        if layout != r.back:
            self.recheck = None
            return None
        r.seen += 1
        if r.seen <= self.settle:
            return None
        if counterfactual_s is not None and counterfactual_s > 0 and measured_s > 0:
            r.ratios.append(measured_s / counterfactual_s)
        if len(r.ratios) < self.window and r.seen < self.patience + self.settle:
            return None
        self.recheck = None
        if len(r.ratios) < min(self.min_samples, self.window):
            return None  # nothing comparable: the block stands
        ratio = float(statistics.median(r.ratios))
        if ratio < 1.0:
            return None  # the source runs faster than the destination did: the switch back was right
        for b in r.buckets:
            self.blocks.pop((r.tried, b), None)
        self.rechecked.add((r.tried, r.back))
        why = (f"after the switch back {r.back} runs at {ratio:.2f}x the pace {r.tried} showed (median of "
               f"{len(r.ratios)}): the slowdown was the machine's, not {r.tried}'s; {r.tried} unblocked")
        v = Verdict(r.back, r.tried, False, ratio, len(r.ratios), median_se(r.ratios), int(step), why,
                    unblocked=True)
        self.verdicts.append(v)
        return v

    def _conclusive(self) -> bool:
        """Whether the regrets so far decide: the median within the margin (keep), or above it by more
        than z standard errors (back). Otherwise the probation collects more comparable steps."""
        p = self.probation
        assert p is not None
        med = float(statistics.median(p.regrets))
        return med <= 1 + self.margin or med > 1 + self.margin + self.z * self._se(p)

    @staticmethod
    def _se(p: Probation) -> float:
        """Standard error of the median regret: the destination's own noise (the regrets' spread) and
        the source's reference pace, which does not shrink with more destination steps."""
        if not p.regrets:
            return float("nan")
        med = float(statistics.median(p.regrets))
        ref = med * float(statistics.median(p.ref_se)) if p.ref_se else 0.0
        return float(math.hypot(median_se(p.regrets), ref))

    def _judge(self, step: int) -> Verdict:
        p = self.probation
        assert p is not None
        self.probation = None
        regret = float(statistics.median(p.regrets)) if p.regrets else float("nan")
        se = self._se(p)
        enough = len(p.regrets) >= min(self.min_samples, self.window)
        slower = enough and regret > 1 + self.margin
        back = slower and regret > 1 + self.margin + self.z * se
        if back:
            for b in p.buckets:
                self.blocks[(p.dst, b)] = step + self.block_steps
            if (p.dst, p.src) not in self.rechecked:
                self.recheck = Recheck(p.src, p.dst, int(step), set(p.buckets))
            self.switch_backs[(p.dst, p.src)] = self.switch_backs.get((p.dst, p.src), 0) + 1
            why = (f"{p.dst} ran {regret - 1:.1%} slower than {p.src} would have on comparable steps "
                   f"(median of {len(p.regrets)}, standard error {se:.1%}) > margin {self.margin:.1%} + "
                   f"{self.z:g} standard errors: back to {p.src}, {p.dst} blocked there for "
                   f"{self.block_steps} steps")
        elif slower:
            why = (f"{p.dst} ran {regret - 1:.1%} slower than {p.src} would have (median of "
                   f"{len(p.regrets)}), within the noise (margin {self.margin:.1%} + {self.z:g} x standard "
                   f"error {se:.1%}): "
                   "switch kept; the policy weighs both layouts at their measured pace")
        elif enough:
            why = (f"{p.dst} paces at {regret:.2f}x {p.src} on comparable steps (median of "
                   f"{len(p.regrets)}): switch kept")
        else:
            why = (f"only {len(p.regrets)} step(s) of {p.dst} comparable with {p.src}'s recent ones in "
                   f"{p.seen} steps: switch kept")
        v = Verdict(p.src, p.dst, back, regret, len(p.regrets), se, int(step), why)
        self.verdicts.append(v)
        return v

    @property
    def holding(self) -> bool:
        """Whether the policy should wait for the verdict: a probation within its first settle + window
        steps (past that, comparable steps are scarce and the policy's own correction may move)."""
        p = self.probation
        return p is not None and p.seen < self.settle + self.window

    def blocked(self, layout: str, bucket: int, step: int) -> bool:
        """Whether the guard keeps `layout` out of the candidates at this bucket now."""
        until = self.blocks.get((layout, int(bucket)))
        return until is not None and step < until

    @property
    def num_switch_backs(self) -> int:
        return sum(self.switch_backs.values())
