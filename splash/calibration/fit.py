"""Fit theta of Eq 10 to measured step times (numpy only).

Eq 10 is linear in theta's inverse rates and latencies once its max() branches are fixed (which of
compute or memory bounds each stage, which rank is busiest, whether communication is exposed):
`costmodel.step_features` gives that linear form. The fit alternates: fix the branches at the current
theta, solve a non-negative least squares on *relative* error (rows weighted by 1/measured, so a
20 ms decode step counts as much as a 1 s prefill), re-derive the branches, repeat until they stop
changing. Several starts (the profile prior, a memory-bound and a compute-bound variant) guard
against a branch that the first start never visits; the result with the lowest relative error under
the true (max) model wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from splash.costmodel import FIT_PARAMS, Batch, Theta, step_cost, step_features, theta_params, with_params
from splash.layouts import Layout
from splash.sizes import AttentionSizes


@dataclass(frozen=True)
class Observation:
    """One measured step: a layout on a batch took `seconds` (median over repetitions)."""

    layout: Layout
    batch: Batch
    seconds: float


@dataclass
class FitResult:
    theta: Theta
    rel_rmse: float  # sqrt(mean(((pred - measured) / measured)^2)) on the fitted observations
    iterations: int
    start: str  # which start won
    history: list[tuple[str, float]] = field(default_factory=list)  # (start, rel_rmse) of every start


def nnls(A: np.ndarray, b: np.ndarray, tol: float = 1e-12, max_iter: int | None = None) -> np.ndarray:
    """min ||A x - b|| subject to x >= 0 (Lawson-Hanson active set; scipy is not a dependency)."""
    m, n = A.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 3 * n + 10
    w = A.T @ (b - A @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            neg = passive & (z <= tol)
            alpha = float(np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
        w = A.T @ (b - A @ x)
    return np.maximum(x, 0.0)


def predict(theta: Theta, sizes: AttentionSizes, obs: Sequence[Observation],
            page_size: int | None) -> np.ndarray:
    return np.array([step_cost(o.layout, sizes, o.batch, theta, page_size).total for o in obs])


def rel_rmse(theta: Theta, sizes: AttentionSizes, obs: Sequence[Observation], page_size: int | None) -> float:
    y = np.array([o.seconds for o in obs])
    return float(np.sqrt(np.mean(((predict(theta, sizes, obs, page_size) - y) / y) ** 2)))


def _branch_key(theta: Theta, sizes: AttentionSizes, obs: Sequence[Observation],
                page_size: int | None) -> bytes:
    X = np.array([step_features(o.layout, sizes, o.batch, theta, page_size) for o in obs])
    return (X != 0).tobytes()


def _refit(theta: Theta, sizes: AttentionSizes, obs: Sequence[Observation], page_size: int | None,
           fixed: Sequence[str]) -> Theta:
    """One linear solve with the branches `theta` selects; parameters without data keep their value."""
    X = np.array([step_features(o.layout, sizes, o.batch, theta, page_size) for o in obs])
    y = np.array([o.seconds for o in obs])
    A = X / y[:, None]
    p0 = theta_params(theta)
    free = np.array([name not in fixed for name in FIT_PARAMS]) & (np.abs(A).max(axis=0) > 0)
    rhs = np.ones(len(y)) - A[:, ~free] @ p0[~free]  # fixed / unseen parameters stay as they are
    scale = np.linalg.norm(A[:, free], axis=0)
    p = p0.copy()
    if free.any():
        p[free] = nnls(A[:, free] / scale, rhs) / scale
    return with_params(theta, p)


def starts(prior: Theta) -> list[tuple[str, Theta]]:
    """The prior, and variants whose memory (or compute) terms dominate every stage at first."""
    big = 1e30
    mem = with_params(prior, theta_params(prior) * np.array([1, 1, 1, 1 / big, 1, 1 / big, 1, 1, 1, 1]))
    comp = with_params(prior, theta_params(prior) * np.array([1, 1, 1, 1, 1 / big, 1, 1 / big, 1, 1, 1]))
    return [("prior", prior), ("memory-bound", mem), ("compute-bound", comp)]


def fit_theta(obs: Sequence[Observation], sizes: AttentionSizes, prior: Theta, page_size: int | None = None,
              iterations: int = 30, fixed: Sequence[str] = ()) -> FitResult:
    """Least-squares theta for `obs` (relative error), alternating branch assignment and NNLS."""
    if not obs:
        raise ValueError("no observations to fit")
    unknown = set(fixed) - set(FIT_PARAMS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)}; choose from {FIT_PARAMS}")
    best: FitResult | None = None
    history = []
    for name, theta in starts(prior):
        cur, cur_err, its = theta, rel_rmse(theta, sizes, obs, page_size), 0
        seen: set[bytes] = set()
        for its in range(1, iterations + 1):
            key = _branch_key(cur, sizes, obs, page_size)
            if key in seen:
                break  # the branches repeat: converged (or cycling between equal-error fits)
            seen.add(key)
            nxt = _refit(cur, sizes, obs, page_size, fixed)
            err = rel_rmse(nxt, sizes, obs, page_size)
            if err <= cur_err or its == 1:
                cur, cur_err = nxt, err
            else:
                break
        history.append((name, cur_err))
        if best is None or cur_err < best.rel_rmse:
            best = FitResult(cur, cur_err, its, name)
    assert best is not None
    best.history = history
    return best
