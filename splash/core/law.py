"""The illustrative timing law of appendix B (Eq 11, 12) and its crossovers (Figures 1, 6, 7).

x = L/1024 for nominal input L, a(x) = 0.05x + 1.2x/(x+8), [z]+ = max(z, 0):
  tau_TP(x)  = 0.40 + 0.25x + [0.15 - 0.0625x]+
  tau_DP(x)  = 2.45 + a(x)
  tau_CP(x)  = 2.55 + 0.05x + [3.40 - 0.025x]+
  tau_DOP(x) = 0.45 + a(x) + [4.80 - 0.35a(x)]+
latency_h(x) = tau(x/alpha_h) / tau_TP(1/alpha_h). Crossovers are *computed*: the fastest (optionally
fastest feasible) layout is scanned on a fine grid and each change is root-found by bisection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError

# alpha_h: the scenario's sampled TP input limit over the DCU reference limit of 58.875k.
ALPHA = {"dcu": 1.0, "h200": 0.6252985669, "b200": 1.2853801752}
# The B200 figure's displayed limits: TP sampled, the others prescribed scenario boundaries (k).
B200_DISPLAYED_LIMITS_K = {Layout.TP: 75.68, Layout.DP: 400.0, Layout.CP: 450.0, Layout.DOP: 512.0}


def _pos(z: np.ndarray) -> np.ndarray:
    return np.maximum(z, 0.0)


def core(x: np.ndarray) -> np.ndarray:
    """a(x): the owner layouts' shared core time."""
    return 0.05 * x + 1.2 * x / (x + 8)


def tau(layout: Layout, x: float | np.ndarray) -> np.ndarray:
    """Dimensionless reference cost of Eq 11 at x = L/1024."""
    x = np.asarray(x, dtype=float)
    if layout is Layout.TP:
        return 0.40 + 0.25 * x + _pos(0.15 - 0.0625 * x)
    if layout is Layout.DP:
        return 2.45 + core(x)
    if layout is Layout.CP:
        return 2.55 + 0.05 * x + _pos(3.40 - 0.025 * x)
    a = core(x)
    return 0.45 + a + _pos(4.80 - 0.35 * a)


def alpha(scenario: str) -> float:
    try:
        return ALPHA[scenario.lower()]
    except KeyError:
        raise ConfigError(f"unknown scenario {scenario!r}; choose one of {', '.join(ALPHA)}") from None


def latency(layout: Layout, tokens: float | np.ndarray, scenario: str) -> np.ndarray:
    """Eq 12: normalised latency at nominal input `tokens` (relative to TP at 1k)."""
    a = alpha(scenario)
    x = np.asarray(tokens, dtype=float) / 1024
    return tau(layout, x / a) / tau(Layout.TP, 1 / a)


@dataclass(frozen=True)
class Crossover:
    tokens: float
    src: Layout
    dst: Layout
    cause: str  # "speed" (curves cross) or "capacity" (the faster layout's KV limit)

    @property
    def at_k(self) -> float:
        return round(float(self.tokens) / 1024, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"at_k": self.at_k, "at_tokens": round(float(self.tokens), 1), "from": self.src.label,
                "to": self.dst.label, "cause": self.cause}


def fastest(tokens: np.ndarray, scenario: str, limits: dict[Layout, float] | None = None) -> np.ndarray:
    """Index into LAYOUTS of the fastest (feasible) layout at each input, -1 where none fits."""
    lat = np.stack([latency(lay, tokens, scenario) for lay in LAYOUTS])
    if limits:
        for i, lay in enumerate(LAYOUTS):
            lat[i, np.asarray(tokens) > limits.get(lay, np.inf)] = np.inf
    best = lat.argmin(axis=0)
    return np.where(np.isinf(lat.min(axis=0)), -1, best)


def crossovers(scenario: str, lo: float = 1024, hi: float = 512 * 1024, step: float = 8.0,
               limits: dict[Layout, float] | None = None) -> list[Crossover]:
    """Every change of the fastest (feasible) layout on [lo, hi] tokens, to ~1e-6 tokens.

    `limits` (tokens) masks a layout beyond its KV limit; a change into "nothing fits" ends the
    scan and is not a crossover.
    """
    if not 0 < lo < hi:
        raise ConfigError(f"scan range must satisfy 0 < lo < hi, got [{lo}, {hi}]")
    grid = np.arange(lo, hi + step, step, dtype=float)
    grid[-1] = min(grid[-1], hi)
    best = fastest(grid, scenario, limits)
    out: list[Crossover] = []
    for j in np.flatnonzero(best[1:] != best[:-1]):
        a, b = int(best[j]), int(best[j + 1])
        if a < 0 or b < 0:
            continue
        la, lb = LAYOUTS[a], LAYOUTS[b]
        limit_a = (limits or {}).get(la, np.inf)
        if grid[j] <= limit_a < grid[j + 1]:
            out.append(Crossover(float(limit_a), la, lb, "capacity"))
            continue
        x0, x1 = grid[j], grid[j + 1]
        for _ in range(80):
            mid = (x0 + x1) / 2
            if float(latency(la, mid, scenario) - latency(lb, mid, scenario)) <= 0:
                x0 = mid
            else:
                x1 = mid
        out.append(Crossover((x0 + x1) / 2, la, lb, "speed"))
    return out


def plot_law(scenario: str, path: str, limits: dict[Layout, float] | None = None,
             hi: float = 512 * 1024, title: str | None = None) -> None:
    """A figure like the paper's Figure 1/6/7: four curves, circles at crossovers, crosses at limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(1024, hi, 2000)
    colors = {Layout.TP: "tab:blue", Layout.DP: "tab:orange", Layout.CP: "tab:green", Layout.DOP: "tab:red"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for lay in LAYOUTS:
        y = latency(lay, grid, scenario)
        name = "DP-attention" if lay is Layout.DP else lay.label
        ax.plot(grid / 1024, y, color=colors[lay], label=name)
        if limits and lay in limits and limits[lay] <= hi:
            ax.plot(limits[lay] / 1024, float(latency(lay, limits[lay], scenario)), "x", color=colors[lay],
                    markersize=9, mew=2)
            ax.axvspan(limits[lay] / 1024, hi / 1024, ymin=0, ymax=0.03, color=colors[lay], alpha=0.25,
                       hatch="//")
    for c in crossovers(scenario, hi=hi, limits=limits):
        y = float(latency(c.dst, c.tokens, scenario))
        ax.plot(c.tokens / 1024, y, "o", mfc="none", mec="black", markersize=10)
        ax.annotate(f"{c.at_k}k", (c.tokens / 1024, y), textcoords="offset points", xytext=(4, -14))
    others = max(float(latency(lay, hi, scenario)) for lay in LAYOUTS if lay is not Layout.TP)
    ax.set_ylim(-1, others * 1.25)  # TP's line leaves the frame, as in the paper's figures
    ax.set_xlabel("Nominal input length (k = 1024 tokens)")
    ax.set_ylabel("Normalized latency (lower is better)")
    ax.set_title(title or f"Illustrative timing law, {scenario} (relative to TP at 1k)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
