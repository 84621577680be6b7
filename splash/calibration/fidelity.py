"""How well a theta picks layouts: predicted vs measured step time per layout on held-out points.

Per point: the predicted and measured time of every layout, the predicted best (argmin of Eq 10) and
the measured best (argmin of the medians), and the regret of following the prediction:
measured(predicted best) / measured(best) - 1. A point whose layouts are within measurement noise of
each other can be "missed" at almost no cost, so both the hit rate and the regret are reported, and
how decisive each point was: its measured best leads the runner-up by more than twice the standard
error of that difference (`tied` otherwise). The headline hit rate counts every held-out point; the
hit rate on the decisive ones is reported beside it, never instead of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splash.calibration.grid import GridPoint
from splash.calibration.measure import Timing
from splash.core.costmodel import step_cost
from splash.core.layouts import Layout
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

REGRET_OK = 0.10  # the acceptance bound: the chosen layout within 10% of the measured best


@dataclass(frozen=True)
class PointFidelity:
    point: GridPoint
    measured: dict[str, float]  # layout -> median seconds
    spread: dict[str, float]  # layout -> IQR / median of one step
    se: dict[str, float]  # layout -> relative standard error of the median
    predicted: dict[str, float]  # layout -> Eq 10 seconds
    pred_best: str
    meas_best: str

    @property
    def hit(self) -> bool:
        return self.pred_best == self.meas_best

    @property
    def regret(self) -> float:
        return self.measured[self.pred_best] / self.measured[self.meas_best] - 1

    @property
    def noise(self) -> float:
        """Standard error of the measured gap between the two fastest layouts (relative)."""
        two = sorted(self.measured, key=self.measured.__getitem__)[:2]
        return sum(self.se[lay] ** 2 for lay in two) ** 0.5

    @property
    def tied(self) -> bool:
        """The measured best leads the runner-up by less than two standard errors: which of them is
        faster is not settled by the measurement."""
        return self.runner_up_gap < 2 * self.noise

    @property
    def runner_up_gap(self) -> float:
        """How much slower the measured second-best layout is than the best (0 with one layout)."""
        t = sorted(self.measured.values())
        return t[1] / t[0] - 1 if len(t) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.point.to_dict(), "measured_s": self.measured, "spread": self.spread, "se": self.se,
                "predicted_s": self.predicted, "pred_best": self.pred_best, "meas_best": self.meas_best,
                "hit": self.hit, "regret": self.regret, "runner_up_gap": self.runner_up_gap,
                "noise": self.noise, "tied": self.tied}


@dataclass(frozen=True)
class Summary:
    points: int
    hit_rate: float  # predicted best == measured best
    within_10: float  # regret <= 10%
    mean_regret: float
    max_regret: float
    rel_rmse: float  # of predicted vs measured step times, all layouts
    tied: float = float("nan")  # share of points whose best two layouts are within measurement noise
    hit_rate_decisive: float = float("nan")  # hit rate on the points that are not tied

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: no held-out points gives nulls, not NaN."""
        d = {"hit_rate": self.hit_rate, "within_10pct": self.within_10, "mean_regret": self.mean_regret,
             "max_regret": self.max_regret, "rel_rmse": self.rel_rmse, "tied": self.tied,
             "hit_rate_decisive": self.hit_rate_decisive}
        return {"points": self.points, **{k: (None if math.isnan(v) else v) for k, v in d.items()}}


def evaluate(theta: Theta, sizes: AttentionSizes, timings: Mapping[tuple[str, GridPoint], Timing],
             points: Sequence[GridPoint], layouts: Sequence[str],
             page_size: int | None) -> list[PointFidelity]:
    out = []
    for p in sorted(points):
        batch = p.batch(theta.ranks)
        meas = {lay: timings[(lay, p)].median for lay in layouts}
        spread = {lay: timings[(lay, p)].spread for lay in layouts}
        se = {lay: timings[(lay, p)].se for lay in layouts}
        pred = {lay: step_cost(Layout.parse(lay), sizes, batch, theta, page_size).total for lay in layouts}
        out.append(PointFidelity(p, meas, spread, se, pred, min(pred, key=pred.__getitem__),
                                 min(meas, key=meas.__getitem__)))
    return out


def summarize(rows: Sequence[PointFidelity]) -> Summary:
    if not rows:
        return Summary(0, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"))
    n = len(rows)
    regrets = [r.regret for r in rows]
    errs = [(r.predicted[lay] - t) / t for r in rows for lay, t in r.measured.items()]
    decisive = [r for r in rows if not r.tied]
    return Summary(n, sum(r.hit for r in rows) / n, sum(g <= REGRET_OK + 1e-12 for g in regrets) / n,
                   sum(regrets) / n, max(regrets), (sum(e * e for e in errs) / len(errs)) ** 0.5,
                   sum(r.tied for r in rows) / n,
                   sum(r.hit for r in decisive) / len(decisive) if decisive else float("nan"))


def format_table(rows: Sequence[PointFidelity], layouts: Sequence[str]) -> str:
    """The fidelity table: per point, predicted/measured ms per layout (* = measured best), both bests,
    regret, the measured runner-up's gap and its standard error (`tie` when the gap is under 2 se)."""
    head = f"{'B':>4} {'s':>5} {'q':>4} | " + " | ".join(f"{lay:>17}" for lay in layouts)
    head += " | pred  meas  regret  gap2   se"
    sub = f"{'':>16}| " + " | ".join(f"{'pred/meas ms':>17}" for _ in layouts) + " |"
    lines = [head, sub, "-" * len(head)]
    for r in rows:
        cells = []
        for lay in layouts:
            mark = "*" if lay == r.meas_best else " "
            cells.append(f"{r.predicted[lay] * 1e3:7.1f}/{r.measured[lay] * 1e3:7.1f}{mark} ")
        flag = "" if r.hit else ("  (miss)" if r.regret > REGRET_OK else "  (miss, within 10%)")
        flag += "  tie" if r.tied else ""
        left = f"{r.point.B:>4} {r.point.s:>5} {r.point.q:>4} | " + " | ".join(f"{c:>17}" for c in cells)
        lines.append(left + f" | {r.pred_best:>4}  {r.meas_best:>4}  {r.regret:6.1%}  "
                     f"{r.runner_up_gap:5.1%}  {r.noise:5.1%}{flag}")
    return "\n".join(lines)


def format_summary(s: Summary, label: str = "") -> str:
    tag = f"{label}: " if label else ""
    decisive = round(s.points * (1 - s.tied)) if s.points else 0
    return (f"{tag}{s.points} held-out points: predicted best == measured best in {s.hit_rate:.0%} "
            f"(target >= 80%); chosen layout within 10% of the best in {s.within_10:.0%}; regret mean "
            f"{s.mean_regret:.1%}, max {s.max_regret:.1%}; step-time error (rel. RMSE) {s.rel_rmse:.1%}; "
            f"best two layouts tied (gap < 2 standard errors) at {s.tied:.0%} of the points; "
            + (f"hit rate on the {decisive} decisive ones {s.hit_rate_decisive:.0%}" if decisive
               else "no decisive point"))


def repeatability(timings: Mapping[tuple[str, GridPoint], Timing], points: Sequence[GridPoint],
                  layouts: Sequence[str]) -> float:
    """Share of points where the first and second half of the repetitions (with 2 rounds: round 1
    vs round 2) pick the same best layout - the ceiling any predictor's hit rate can reach against
    measurements this noisy. NaN without at least two timings per (layout, point)."""
    import statistics

    agree, n = 0, 0
    for p in points:
        halves = []
        for part in (0, 1):
            med = {}
            for lay in layouts:
                t = timings[(lay, p)].times
                h = len(t) // 2
                if h == 0:
                    return float("nan")
                med[lay] = statistics.median(t[:h] if part == 0 else t[h:])
            halves.append(min(med, key=med.__getitem__))
        agree += halves[0] == halves[1]
        n += 1
    return agree / n if n else float("nan")
