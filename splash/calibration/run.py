"""`calibrate()`: measure every layout over a grid, fit theta on part of it, check it on the rest."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splash.calibration.fidelity import PointFidelity, Summary, evaluate, repeatability, summarize
from splash.calibration.fit import FitResult, Observation, fit_theta
from splash.calibration.grid import GridPoint, split_holdout
from splash.calibration.measure import Timing, measure
from splash.core.layouts import DEFAULT_PAGE_SIZE, LAYOUT_NAMES, Layout
from splash.core.prior import default_profile, runtime_prior
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta


@dataclass
class Calibration:
    theta: Theta  # fitted on the training points (the one that was validated, and saved)
    prior: Theta
    fit: FitResult
    train: list[GridPoint]
    held: list[GridPoint]
    layouts: list[str]
    timings: dict[tuple[str, GridPoint], Timing]
    rows: list[PointFidelity]  # held-out fidelity of `theta`
    summary: Summary
    prior_rows: list[PointFidelity]  # the same points under the uncalibrated prior, for comparison
    prior_summary: Summary
    repeatability: float  # halves of the measurements agreeing on the best layout (all points)
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"theta": self.theta.to_dict(), "fit": {"rel_rmse_train": self.fit.rel_rmse,
                                                        "start": self.fit.start,
                                                        "iterations": self.fit.iterations},
                "layouts": self.layouts, "train": [p.to_dict() for p in self.train],
                "heldout": [r.to_dict() for r in self.rows], "summary": self.summary.to_dict(),
                "prior_summary": self.prior_summary.to_dict(),
                "repeatability": None if math.isnan(self.repeatability) else self.repeatability,
                "timings": [t.to_dict() for t in self.timings.values()], "seconds": self.seconds}


def observations(timings: Mapping[tuple[str, GridPoint], Timing], points: Sequence[GridPoint],
                 layouts: Sequence[str], ranks: int) -> list[Observation]:
    return [Observation(Layout.parse(lay), p.batch(ranks), timings[(lay, p)].median)
            for p in points for lay in layouts]


def fit_and_check(timings: Mapping[tuple[str, GridPoint], Timing], points: Sequence[GridPoint],
                  layouts: Sequence[str], ranks: int, sizes: AttentionSizes, prior: Theta,
                  page_size: int, holdout_every: int = 3) -> tuple[FitResult, list[GridPoint],
                                                                  list[GridPoint]]:
    """Split the grid, fit theta on the training points (pure: no timing here)."""
    train, held = split_holdout(points, holdout_every)
    fit = fit_theta(observations(timings, train, layouts, ranks), sizes, prior, page_size)
    return fit, train, held


def calibrate(ranks: int, points: Sequence[GridPoint], *, layouts: Sequence[str] = LAYOUT_NAMES,
              model: str = "tiny", dtype: str = "float32", page_size: int = DEFAULT_PAGE_SIZE, reps: int = 16,
              warmup: int = 2, rounds: int = 2, device: str | None = None, profile: str | None = None,
              holdout_every: int = 3, seed: int = 0, progress: bool = True) -> Calibration:
    """Time the grid on `ranks` ranks, fit theta on 2/3 of the points, report fidelity on the rest."""
    from splash.core.model_config import ModelConfig
    from splash.model import resolve_model_path

    t_start = time.perf_counter()
    cfg = ModelConfig.from_hf(resolve_model_path(model))
    cfg.check_ranks(ranks)
    sizes = AttentionSizes(cfg, dtype, dtype)
    prof = profile or default_profile(device)
    prior = runtime_prior(ranks, sizes, prof)
    timings = measure(points, layouts, ranks, model=model, dtype=dtype, page_size=page_size, reps=reps,
                      warmup=warmup, rounds=rounds, device=device, seed=seed, progress=progress)
    fit, train, held = fit_and_check(timings, points, layouts, ranks, sizes, prior, page_size, holdout_every)
    d = fit.theta.to_dict()
    d.update(name=f"{cfg.name or model}-{prof}x{ranks}-calibrated",
             source=(f"splash calibrate: {len(train)} training points x {len(layouts)} layouts, "
                     f"{reps} reps x {rounds} round(s), {dtype}, page {page_size}, on {platform.node()} "
                     f"{time.strftime('%Y-%m-%d %H:%M')}; train rel. RMSE {fit.rel_rmse:.1%}"))
    theta = Theta.from_dict(d)
    rows = evaluate(theta, sizes, timings, held, layouts, page_size)
    prior_rows = evaluate(prior, sizes, timings, held, layouts, page_size)
    return Calibration(theta, prior, fit, train, held, list(layouts), timings, rows, summarize(rows),
                       prior_rows, summarize(prior_rows), repeatability(timings, points, layouts),
                       time.perf_counter() - t_start)
