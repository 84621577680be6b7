"""The regret guard: after a voluntary switch, check that the destination really runs faster.

The policy switches on predictions; a prediction can be wrong for this machine today. So after a
switch src -> dst chosen by the policy, the guard watches dst's next `window` measured steps (after
`settle` steps that may still pay for the switch) and compares each with what src would have taken
on the same batch: src's own recent pace on comparable steps (the same batch-size bucket and mix;
the runtime computes it as src's measured ratio there x src's prediction for this batch, see
`correction.StepCorrection.measured`). A probation that finds fewer than `min_samples` comparable
steps within `patience` steps keeps the switch. If the median of measured(dst) / counterfactual(src) exceeds
1 + margin, the switch made things slower: the guard asks to switch back and blocks dst in the
buckets it was tried on for `block_steps` steps. Hysteresis: a switch back is not itself watched, and
a blocked layout is no candidate, so the pair cannot flap. Pure and step-clocked: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.core.config import ConfigError


@dataclass
class Probation:
    """A switch under watch: the destination's regrets so far."""

    src: str
    dst: str
    step: int  # the step that switched
    regrets: list[float] = field(default_factory=list)
    buckets: set[int] = field(default_factory=set)
    seen: int = 0  # steps observed in dst (comparable or not)


@dataclass(frozen=True)
class Verdict:
    """The end of a probation: keep the switch, or go back."""

    src: str
    dst: str
    switch_back: bool
    regret: float  # median measured(dst) / counterfactual(src); nan when nothing was comparable
    samples: int
    step: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "switch_back": self.switch_back,
                "regret": None if np.isnan(self.regret) else round(self.regret, 4), "samples": self.samples,
                "step": self.step, "reason": self.reason}


class RegretGuard:
    def __init__(self, margin: float = 0.05, window: int = 8, settle: int = 1, block_steps: int = 2000,
                 patience: int = 64, min_samples: int = 3) -> None:
        if not 0 <= margin < 1:
            raise ConfigError(f"regret guard: margin must be in [0, 1), got {margin}")
        if window < 1 or settle < 0 or block_steps < 0 or patience < window:
            raise ConfigError("regret guard: need window >= 1, settle >= 0, block_steps >= 0, "
                              "patience >= window")
        self.margin, self.window, self.settle = margin, window, settle
        self.block_steps, self.patience = block_steps, patience
        self.min_samples = min_samples  # fewest comparable steps a switch back rests on (<= window)
        self.probation: Probation | None = None
        self.blocks: dict[tuple[str, int], int] = {}  # (layout, bucket) -> blocked until this step
        self.verdicts: list[Verdict] = []
        self.switch_backs: dict[tuple[str, str], int] = {}

    def switched(self, step: int, src: str, dst: str, voluntary: bool) -> None:
        """A switch committed at `step`. Only the policy's own (voluntary) switches are watched; any
        other switch (forced, requested, a switch back) ends a probation unjudged."""
        self.probation = Probation(src, dst, int(step)) if voluntary and src != dst else None

    def observe(self, step: int, layout: str, bucket: int, measured_s: float,
                counterfactual_s: float | None) -> Verdict | None:
        """One measured step; a Verdict when this step ends a probation."""
        p = self.probation
        if p is None:
            return None
        if layout != p.dst:  # the layout changed under the guard: nothing left to judge
            self.probation = None
            return None
        p.seen += 1
        if p.seen <= self.settle:
            return None
        if counterfactual_s is not None and counterfactual_s > 0 and measured_s > 0:
            p.regrets.append(measured_s / counterfactual_s)
            p.buckets.add(int(bucket))
        if len(p.regrets) >= self.window:
            return self._judge(step)
        if p.seen >= self.patience + self.settle:  # never comparable enough: keep the switch
            return self._judge(step)
        return None

    def _judge(self, step: int) -> Verdict:
        p = self.probation
        assert p is not None
        self.probation = None
        regret = float(np.median(p.regrets)) if p.regrets else float("nan")
        enough = len(p.regrets) >= min(self.min_samples, self.window)
        back = enough and regret > 1 + self.margin
        if back:
            for b in p.buckets:
                self.blocks[(p.dst, b)] = step + self.block_steps
            self.switch_backs[(p.dst, p.src)] = self.switch_backs.get((p.dst, p.src), 0) + 1
            why = (f"{p.dst} ran {regret - 1:.1%} slower than {p.src} would have on comparable steps "
                   f"(median of {len(p.regrets)}) > margin {self.margin:.1%}: back to {p.src}, {p.dst} "
                   f"blocked there for {self.block_steps} steps")
        elif enough:
            why = (f"{p.dst} paces at {regret:.2f}x {p.src} on comparable steps (median of "
                   f"{len(p.regrets)}): switch kept")
        else:
            why = (f"only {len(p.regrets)} step(s) of {p.dst} comparable with {p.src}'s recent ones in "
                   f"{p.seen} steps: switch kept")
        v = Verdict(p.src, p.dst, back, regret, len(p.regrets), int(step), why)
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
