"""Online correction of the cost model from the engine's own step times (pure Python, no torch).

A prior theta (a calibration made on another day, or a profile made for other hardware) is off for the
machine's state by a factor that differs per layout and batch size, and that drifts: one layout's step
time varies 10-20% between runs on a shared machine. The runtime reports every step it runs
(`observe`: layout, batch shape, predicted and measured seconds); `estimate` gives the policy the
factor to multiply a prediction by and how uncertain it is:

- "measured": the median of this layout's last `window` measured/predicted ratios in this cell (a
  batch-size bucket, decode-only or with prefill rows), once it holds `min_samples` fresh ones.
  The median, not a mean: one step that a neighbour's job stalled does not move it.
- "relative": measured in another bucket (the nearest, same mix) next to other layouts: its ratio
  relative to theirs there, times theirs here, with uncertainty `per_bucket` per bucket of distance.
  The prior's error in how a step grows with the batch is shared by every layout and cancels (on the
  2-core VM the ratio of one layout varies 0.4-0.7 between buckets); only the layout's own difference
  carries over.
- "borrowed": no reference there: the nearest bucket's absolute ratio, same uncertainty.
- "scale": a layout not run near this batch keeps its prior's shape relative to the others: the
  machine-wide factor (geometric mean of the other layouts' factors here), uncertainty `unmeasured`.
- "prior": nothing measured yet: factor 1, uncertainty `unmeasured`.
The policy prices a candidate at factor x prediction and, for a switch into it, asks for `uncertainty`
more lead on top of its margin (policy.decide). Samples older than `stale_steps` steps stop counting
(the machine moved on); steps are the clock, so everything here is deterministic given its inputs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splash.core.model_config import ConfigError

MIXES = ("decode", "prefill")


def bucket(requests: int) -> int:
    """Batch-size bucket of a step with `requests` requests holding rows: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(0, math.ceil(math.log2(max(1, int(requests)))))


def bucket_label(b: int) -> str:
    lo, hi = (1, 1) if b == 0 else (2 ** (b - 1) + 1, 2 ** b)
    return f"B={lo}" if lo == hi else f"B={lo}-{hi}"


@dataclass(frozen=True)
class StepKey:
    """What makes two steps comparable: batch-size bucket and whether any request prefills."""

    bucket: int
    mix: str = "decode"

    @classmethod
    def sized(cls, requests: int, rows: int) -> StepKey:
        """The key of a step of `requests` requests with `rows` rows in all, each request at least one
        (an engine's step plan, told in O(1)): some request prefills exactly when rows > requests."""
        return cls(bucket(requests), "prefill" if rows > requests else "decode")

    @classmethod
    def of(cls, rows: Iterable[int]) -> StepKey:
        """The key of a step from its rows per request (requests with 0 rows do not count)."""
        active = [int(q) for q in rows if int(q) > 0]
        return cls.sized(len(active), sum(active))

    @property
    def label(self) -> str:
        return f"{self.mix} {bucket_label(self.bucket)}"


@dataclass(frozen=True)
class CorrectionConfig:
    window: int = 16  # recent ratios per (layout, cell) the median runs over
    min_samples: int = 3  # fresh samples before a cell counts as measured
    stale_steps: int = 2000  # a sample older than this many engine steps no longer counts
    per_bucket: float = 0.05  # uncertainty per bucket of distance when borrowing a neighbour's ratio
    unmeasured: float = 0.10  # uncertainty of a layout not run near this batch (its prior's shape)

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.min_samples > self.window:
            raise ConfigError(f"correction: need 1 <= min_samples <= window, got {self.min_samples} and "
                              f"{self.window}")
        if self.stale_steps < 1:
            raise ConfigError(f"correction: stale_steps must be >= 1, got {self.stale_steps}")
        if self.per_bucket < 0 or self.unmeasured < 0:
            raise ConfigError("correction: uncertainties must be >= 0")


@dataclass(frozen=True)
class Estimate:
    """The correction in force for one layout on one kind of step."""

    factor: float  # multiply the cost model's prediction by this
    uncertainty: float  # extra relative lead a switch into this layout must show
    source: str  # "measured" | "relative" | "borrowed" | "scale" | "prior"
    samples: int  # fresh ratios behind it (0 for scale/prior)

    def to_dict(self) -> dict[str, Any]:
        return {"factor": round(self.factor, 4), "uncertainty": round(self.uncertainty, 4),
                "source": self.source, "samples": self.samples}


class StepCorrection:
    """Per layout and StepKey, the recent measured/predicted ratios of the steps the engine ran."""

    def __init__(self, config: CorrectionConfig = CorrectionConfig()) -> None:
        self.config = config
        self.cells: dict[tuple[str, StepKey], deque[tuple[int, float]]] = {}
        self.steps: dict[str, int] = {}  # steps observed per layout (for the summary)
        self.last_step = 0

    def observe(self, layout: str, key: StepKey, predicted_s: float, measured_s: float, step: int) -> None:
        """One step that ran in `layout`: its cost-model prediction and its measured seconds."""
        if not (0 < predicted_s < math.inf and 0 < measured_s < math.inf):
            return  # nothing to learn from an empty or unpriced step
        cell = self.cells.get((layout, key))
        if cell is None:
            cell = self.cells[(layout, key)] = deque(maxlen=self.config.window)
        cell.append((int(step), measured_s / predicted_s))
        self.steps[layout] = self.steps.get(layout, 0) + 1
        self.last_step = max(self.last_step, int(step))

    def fresh(self, layout: str, key: StepKey, step: int | None = None) -> list[float]:
        """The ratios of a cell that still count at `step` (default: the latest step observed)."""
        now = self.last_step if step is None else int(step)
        cell = self.cells.get((layout, key), ())
        return [r for s, r in cell if now - s < self.config.stale_steps]

    def settled(self, layout: str, key: StepKey, step: int) -> bool:
        """Whether `measured` would answer at `step` (min_samples fresh ratios), in O(1): a cell's samples
        come in step order, so its min_samples-th newest decides."""
        cell = self.cells.get((layout, key))
        n = self.config.min_samples
        return cell is not None and len(cell) >= n and int(step) - cell[-n][0] < self.config.stale_steps

    def measured(self, layout: str, key: StepKey, step: int | None = None) -> Estimate | None:
        """This layout's own pace on exactly this kind of step, or None (fewer than min_samples)."""
        here = self.fresh(layout, key, step)
        if len(here) >= self.config.min_samples:
            return Estimate(_median(here), 0.0, "measured", len(here))
        return None

    def _buckets(self, layout: str, key: StepKey, step: int | None) -> list[tuple[int, StepKey]]:
        """(distance, key) of the other buckets (same mix) where `layout` is measured, nearest first."""
        near = [(abs(k.bucket - key.bucket), k) for (lay, k) in self.cells
                if lay == layout and k.mix == key.mix and k != key
                and len(self.fresh(lay, k, step)) >= self.config.min_samples]
        return sorted(near, key=lambda dk: (dk[0], dk[1].bucket))

    def own(self, layout: str, key: StepKey, step: int | None = None) -> Estimate | None:
        """This layout's absolute pace at `key`: measured here, else its ratio in the nearest bucket
        (uncertainty `per_bucket` per bucket of distance)."""
        mine = self.measured(layout, key, step)
        if mine is not None:
            return mine
        near = self._buckets(layout, key, step)
        if not near:
            return None
        d, k = near[0]
        vals = self.fresh(layout, k, step)
        return Estimate(_median(vals), self.config.per_bucket * d, "borrowed", len(vals))

    def relative(self, layout: str, key: StepKey, layouts: Iterable[str],
                 step: int | None = None) -> Estimate | None:
        """`layout` measured in another bucket next to other layouts: its pace *relative* to them
        there, applied to their pace here. The prior's error in how a step grows with the batch is
        shared by every layout and cancels; only the layout's own difference is carried over."""
        others = [lay for lay in layouts if lay != layout]
        for d, k in self._buckets(layout, key, step):
            refs = [(m, e) for lay in others if (m := self.measured(lay, k, step)) is not None
                    and (e := self.own(lay, key, step)) is not None]
            if not refs:
                continue
            mine = self.measured(layout, k, step)
            assert mine is not None
            there = math.exp(sum(math.log(m.factor) for m, _ in refs) / len(refs))
            here = math.exp(sum(math.log(e.factor) for _, e in refs) / len(refs))
            unsure = self.config.per_bucket * d + max(e.uncertainty for _, e in refs)
            return Estimate(mine.factor / there * here, unsure, "relative", mine.samples)
        return None

    def estimate(self, layout: str, key: StepKey, layouts: Iterable[str],
                 step: int | None = None) -> Estimate:
        """The factor and uncertainty for `layout` at `key`; `layouts`: all candidates (the others are
        the reference for a relative or scale estimate)."""
        lays = list(layouts)
        for e in (self.measured(layout, key, step), self.relative(layout, key, lays, step),
                  self.own(layout, key, step)):
            if e is not None:
                return e
        others = [e for lay in lays if lay != layout and (e := self.own(lay, key, step)) is not None]
        if others:
            scale = math.exp(sum(math.log(e.factor) for e in others) / len(others))
            return Estimate(scale, self.config.unmeasured, "scale", 0)
        return Estimate(1.0, self.config.unmeasured, "prior", 0)

    def estimates(self, layouts: Iterable[str], key: StepKey, step: int | None = None) -> dict[str, Estimate]:
        lays = list(layouts)
        return {lay: self.estimate(lay, key, lays, step) for lay in lays}

    def observed_s(self, layout: str, key: StepKey, predicted_s: float,
                   step: int | None = None) -> float | None:
        """What this layout's recent steps say a step like this takes (its measured ratio x the
        prediction), or None when it has not run such steps recently."""
        e = self.measured(layout, key, step)
        return e.factor * predicted_s if e is not None else None

    def summary(self) -> dict[str, Any]:
        """How far the measurements moved the prior: per layout, the median ratio over its fresh
        samples and per cell, with sample counts."""
        out: dict[str, Any] = {}
        for (lay, key), _ in sorted(self.cells.items(), key=lambda kv: (kv[0][0], kv[0][1].mix,
                                                                         kv[0][1].bucket)):
            vals = self.fresh(lay, key)
            if not vals:
                continue
            d = out.setdefault(lay, {"steps": self.steps.get(lay, 0), "cells": {}})
            d["cells"][key.label] = {"ratio": round(float(_median(vals)), 4), "samples": len(vals)}
        for lay, d in out.items():
            allv = [r for (la, k), _ in self.cells.items() if la == lay for r in self.fresh(la, k)]
            d["ratio"] = round(float(_median(allv)), 4)
        return out


def _median(values: Iterable[float]) -> float:
    """Median of a short list (a few dozen at most): no numpy call on the step's critical path."""
    v = sorted(values)
    n = len(v)
    if not n:
        raise ValueError("median of nothing")
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def describe(summary: Mapping[str, Any]) -> str:
    """One line for the log: each layout's overall factor and its sample count."""
    if not summary:
        return "no steps measured yet"
    return ", ".join(f"{lay} x{d['ratio']:.2f} ({d['steps']} steps, {len(d['cells'])} cells)"
                     for lay, d in summary.items())
