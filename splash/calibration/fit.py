"""Fit theta of Eq 10 to measured step times (numpy only).

Eq 10 is linear in theta's inverse rates and latencies once its max() branches are fixed (which of
compute or memory bounds each stage, which rank is busiest, whether communication is exposed):
`features.step_features` gives that linear form. The fit alternates: fix the branches at the current
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

from splash.core.costmodel import Batch, step_cost
from splash.core.features import FIT_PARAMS, step_features, theta_params, with_params
from splash.core.layouts import LAYOUTS, Layout
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta


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


PER_LAYOUT = ("latency", "inv_link_bw")  # communication terms fitted once per layout
_SHARED = [i for i, n in enumerate(FIT_PARAMS) if n not in PER_LAYOUT]  # FIT_PARAMS fitted once for all


def column_names(per_layout: bool) -> list[str]:
    """The fit's unknowns: FIT_PARAMS, with latency and 1/link_bw split by layout when `per_layout`."""
    if not per_layout:
        return list(FIT_PARAMS)
    return [FIT_PARAMS[i] for i in _SHARED] + [f"{n}[{lay.label}]" for n in PER_LAYOUT for lay in LAYOUTS]


def design_row(o: Observation, sizes: AttentionSizes, theta: Theta, page_size: int | None,
               per_layout: bool) -> np.ndarray:
    """Eq 10's linear form for one observation (branches fixed by `theta`), in `column_names` order.

    Per layout: the latency column is L (one per attention layer, times the layout's effective count
    folded into the parameter; 0 on one rank) and the link column is L * R bytes when communication
    is exposed."""
    x = step_features(o.layout, sizes, o.batch, theta, page_size)
    if not per_layout:
        return x
    split = np.zeros(2 * len(LAYOUTS))
    j = LAYOUTS.index(o.layout)
    split[j] = sizes.layers if theta.ranks > 1 else 0
    split[len(LAYOUTS) + j] = x[FIT_PARAMS.index("inv_link_bw")] * theta.link_bw_of(o.layout) / theta.link_bw
    return np.concatenate([x[_SHARED], split])


def column_values(theta: Theta, per_layout: bool) -> np.ndarray:
    """theta in `column_names` order (per layout: latency x effective collectives, 1 / link rate)."""
    p = theta_params(theta)
    if not per_layout:
        return p
    lat = [theta.latency * theta.collectives_of(lay) for lay in LAYOUTS]
    inv = [1 / theta.link_bw_of(lay) for lay in LAYOUTS]
    return np.concatenate([p[_SHARED], lat, inv])


def from_columns(theta: Theta, v: np.ndarray, per_layout: bool, counts: dict[str, float],
                 max_rate: float = 1e30) -> Theta:
    """A theta carrying column values `v`. Per layout, `latency` becomes the median seconds per
    collective (each layout's fitted delta / the collectives the runtime issues, `counts`), and
    `collectives` the effective counts in that unit; `link_bw` the median of the per-layout rates
    (what a switch's bulk transfers are priced at)."""
    if not per_layout:
        return with_params(theta, v)
    nb = len(_SHARED)
    base, lat, inv = v[:nb], np.maximum(v[nb:nb + len(LAYOUTS)], 0), np.maximum(v[nb + len(LAYOUTS):], 0)
    per_coll = [lat[i] / counts[lay.label] for i, lay in enumerate(LAYOUTS)
                if lat[i] > 0 and counts[lay.label] > 0]
    latency = float(np.median(per_coll)) if per_coll else 0.0
    coll = ({lay.label: float(lat[i] / latency) for i, lay in enumerate(LAYOUTS)} if latency > 0
            else dict(counts))
    rates = [min(max_rate, 1 / x) if x > 0 else max_rate for x in inv]
    finite = [r for r in rates if r < max_rate]
    link = float(np.median(finite)) if finite else max_rate
    p = np.zeros(len(FIT_PARAMS))
    p[_SHARED] = base
    p[FIT_PARAMS.index("latency")] = latency
    p[FIT_PARAMS.index("inv_link_bw")] = 1 / link
    d = with_params(theta, p).to_dict()
    d.update(collectives=coll, link_bw_by_layout={lay.label: float(r) for lay, r in zip(LAYOUTS, rates)})
    return Theta.from_dict(d)


def _refit(theta: Theta, sizes: AttentionSizes, obs: Sequence[Observation], page_size: int | None,
           fixed: Sequence[str], per_layout: bool, counts: dict[str, float]) -> Theta:
    """One linear solve with the branches `theta` selects; parameters without data keep their value."""
    X = np.array([design_row(o, sizes, theta, page_size, per_layout) for o in obs])
    y = np.array([o.seconds for o in obs])
    A = X / y[:, None]
    p0 = column_values(theta, per_layout)
    names = column_names(per_layout)
    free = np.array([n.split("[")[0] not in fixed for n in names]) & (np.abs(A).max(axis=0) > 0)
    rhs = np.ones(len(y)) - A[:, ~free] @ p0[~free]  # fixed / unseen parameters stay as they are
    scale = np.linalg.norm(A[:, free], axis=0)
    p = p0.copy()
    if free.any():
        p[free] = nnls(A[:, free] / scale, rhs) / scale
    if per_layout and free[names.index("t0")]:
        p = _common_latency_to_t0(p, names, free, sizes.layers if theta.ranks > 1 else 0)
    return from_columns(theta, p, per_layout, counts)


def _common_latency_to_t0(p: np.ndarray, names: list[str], free: np.ndarray, layers: int) -> np.ndarray:
    """t0 and the per-layout deltas are collinear (every step pays t0 + L * delta of its layout), so
    fix the split: the smallest fitted delta is a per-step cost every layout pays and goes to t0; the
    deltas keep what each layout pays on top. Predictions do not change (for layouts not in the data,
    whose delta stays the prior's, up to clipping at 0)."""
    lat = [i for i, n in enumerate(names) if n.startswith("latency[")]
    seen = [i for i in lat if free[i]]
    if not seen or layers == 0:
        return p
    c = min(p[i] for i in seen)
    q = p.copy()
    q[names.index("t0")] += layers * c
    for i in lat:
        q[i] = max(0.0, q[i] - c)
    return q


def starts(prior: Theta) -> list[tuple[str, Theta]]:
    """The prior, and variants whose memory (or compute) terms dominate every stage at first."""
    big = 1e30

    def scaled(names: tuple[str, ...]) -> Theta:
        factor = np.array([1 / big if n in names else 1.0 for n in FIT_PARAMS])
        return with_params(prior, theta_params(prior) * factor)

    mem = scaled(("inv_flops_proj", "inv_flops_att"))
    comp = scaled(("inv_bw_weights", "inv_bw_kv"))
    return [("prior", prior), ("memory-bound", mem), ("compute-bound", comp)]


def fit_theta(obs: Sequence[Observation], sizes: AttentionSizes, prior: Theta, page_size: int | None = None,
              iterations: int = 30, fixed: Sequence[str] = (), per_layout_comm: bool = True) -> FitResult:
    """Least-squares theta for `obs` (relative error), alternating branch assignment and NNLS.

    `per_layout_comm`: latency and link rate per layout (each layout issues different collectives);
    the prior's `collectives` are taken as the counts the runtime issues."""
    if not obs:
        raise ValueError("no observations to fit")
    unknown = set(fixed) - set(FIT_PARAMS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)}; choose from {FIT_PARAMS}")
    counts = {lay.label: float(prior.collectives_of(lay)) for lay in LAYOUTS}
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
            nxt = _refit(cur, sizes, obs, page_size, fixed, per_layout_comm, counts)
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
