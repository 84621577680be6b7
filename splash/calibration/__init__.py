"""Calibration of theta (Eq 10) for this deployment: `splash calibrate`.

grid.py (which (B, s, q) points), measure.py (timing real steps, torch), fit.py (least squares, numpy),
fidelity.py (held-out check), prior.py (profile prior, `load_or_default_theta`), run.py (the pipeline).
Importing the package pulls no torch; only `measure` / `calibrate` start ranks.
"""

from splash.calibration.grid import GridPoint, default_grid, parse_points, quick_grid, split_holdout
from splash.core.prior import load_or_default_theta, runtime_prior

__all__ = ["GridPoint", "default_grid", "load_or_default_theta", "parse_points", "quick_grid",
           "runtime_prior", "split_holdout"]
