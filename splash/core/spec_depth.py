"""Speculation depth as one more dimension of the configuration the policy picks (SPEC §4.2 extended).

A verify step of depth k runs k + 1 rows per decoding request (its last token and k drafts); request i
then emits E_i(k) = 1 + a_i + ... + a_i^k tokens, a_i its per-draft acceptance (a chain stops at the
first rejection: the geometric model SGLang's and vLLM's analyses use). The step's time is Eq 10's
(`step_cost`) for that batch, plus the draft model's work: with MTP layers, one layer's share of a step
per chained draft (the extend over accepted rows and k - 1 single-row chain steps); n-gram drafts cost
nothing on the ranks. The policy minimises seconds per emitted token over k in 0..K:

    price(k) = (T(l, x_k) + D(k)) * c_k / sum_i E_i(k)

where x_k is the live batch at depth k and c_k the measured/predicted ratio of recent steps at that
depth, drafting included (the engine's own step times; 1 until measured). Wide batches make the step
compute-bound, T grows with the rows and depth 0 wins; a tail of a few long requests is bound by
reading the weights, T barely moves and depth K wins. The choice keeps the layout policy's rules: a
new depth is adopted only when it is `margin` cheaper per token than the current one and the current
depth has run `min_dwell` steps, and a depth above 0 only when it is `gain` cheaper than depth 0
(speculation that merely ties loses in practice: see DepthConfig.gain). Pure Python over the cost
model: the runtime supplies the batch and rates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from splash.core.costmodel import Batch, step_cost
from splash.core.layouts import Layout
from splash.core.model_config import ConfigError
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta


@dataclass(frozen=True)
class DepthConfig:
    max_depth: int  # K: the most drafts a request verifies per step
    margin: float = 0.05  # a new depth must be this much cheaper per token
    # speculating must promise tokens this much cheaper than not: the measured ratios move by about as
    # much from step to step, and drafts spread a batch's progress (its requests finish at different
    # steps, so its tail runs narrower than the same batch without them, which no step's price sees)
    gain: float = 0.1
    min_dwell: int = 8  # steps at a depth before a voluntary change
    draft_layers: int = 0  # MTP layers the drafts run through (0: n-gram drafts, free on the ranks)

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise ConfigError(f"speculation depth policy needs max_depth >= 1, got {self.max_depth}")
        if not 0 <= self.margin < 1 or not 0 <= self.gain < 1 or self.min_dwell < 0:
            raise ConfigError("speculation depth policy: margin and gain in [0, 1), min_dwell >= 0")


def expected_tokens(a: float | np.ndarray, k: int) -> float | np.ndarray:
    """Tokens a verify of k drafts emits on average at per-draft acceptance a: 1 + a + ... + a^k."""
    return sum(np.power(a, j) for j in range(k + 1))


def could_pay(accept: Sequence[float], k: int, gain: float) -> bool:
    """Whether depth k could beat depth 0 by `gain` even if its drafts and verify rows cost nothing:
    the batch's mean tokens a verify emits at acceptance `accept` above 1 / (1 - gain). Where none
    could, running a depth to learn its step time teaches nothing worth its drafts."""
    a = np.clip(np.asarray(accept, dtype=np.float64), 0.0, 1.0)
    return bool(a.size) and float(np.mean(expected_tokens(a, k))) * (1.0 - gain) > 1.0


def acceptance_rate(accepted: float, rejected: float, prior: float, weight: float = 4.0) -> float:
    """Per-draft acceptance of one request: the geometric model's estimate accepted / (accepted +
    rejections), shrunk towards `prior` (the engine-wide rate) with the weight of `weight` drafts."""
    return (accepted + weight * prior) / (accepted + rejected + weight)


def draft_seconds(decode_step_s: float, k: int, cfg: DepthConfig, sizes: AttentionSizes) -> float:
    """D(k): the draft model's time for a chain of k: k MTP forwards of about one layer's share of a
    decode step each (0 for n-gram drafts)."""
    return k * cfg.draft_layers * decode_step_s / max(1, sizes.layers) if cfg.draft_layers else 0.0


def price_depths(sizes: AttentionSizes, theta: Theta, layout: Layout, contexts: Sequence[int],
                 accept: Sequence[float], cfg: DepthConfig, ratios: Mapping[int, float] | None = None,
                 owners: Sequence[int] | None = None, others: int = 0) -> dict[int, float]:
    """Seconds per emitted token at each depth 0..K for decoding requests of `contexts` (their KV
    before this step) with per-draft acceptance `accept`, in `layout` on theta.ranks ranks. `others`:
    rows of the step that are not decoding (prefill chunks), priced alike at every depth."""
    if not len(contexts):
        return {0: 0.0}
    return prices(depth_times(sizes, theta, layout, contexts, cfg, owners, others), accept, ratios)


def depth_times(sizes: AttentionSizes, theta: Theta, layout: Layout, contexts: Sequence[int],
                cfg: DepthConfig, owners: Sequence[int] | None = None, others: int = 0) -> dict[int, float]:
    """T(l, x_k) + D(k): the predicted seconds of a step at each depth 0..K (drafting included)."""
    s = np.asarray(contexts, dtype=np.int64)
    out: dict[int, float] = {}
    base = None
    for k in range(cfg.max_depth + 1):
        q = np.full(len(s), k + 1, dtype=np.int64)
        ctx = list(s + q)
        rows = list(q)
        own = None if owners is None else list(owners)
        if others:  # the step's other rows, as one request of their own
            ctx.append(int(others))
            rows.append(int(others))
            own = None if own is None else [*own, 0]
        t = step_cost(layout, sizes, Batch.make(ctx, rows, own, theta.ranks), theta).total
        if base is None:
            base = t
        out[k] = t + draft_seconds(base, k, cfg, sizes)
    return out


def prices(times: Mapping[int, float], accept: Sequence[float],
           ratios: Mapping[int, float] | None = None) -> dict[int, float]:
    """Seconds per emitted token at each depth: the step `times` (corrected by `ratios`) over the
    tokens the requests of per-draft acceptance `accept` emit."""
    a = np.clip(np.asarray(accept, dtype=np.float64), 0.0, 1.0)
    r = ratios or {}
    return {k: t * r.get(k, 1.0) / float(np.sum(expected_tokens(a, k))) for k, t in times.items()}


def choose_depth(prices: Mapping[int, float], current: int, steps_at_current: int, cfg: DepthConfig) -> int:
    """The depth to run: the cheapest per token among no speculation and the depths that beat it by
    `gain`, adopted only with the margin (or at once when the current depth no longer beats depth 0 by
    `gain`) and after the dwell."""
    none = prices.get(0)
    paying = {k: p for k, p in prices.items() if k == 0 or none is None or p < (1.0 - cfg.gain) * none}
    best = min(paying, key=lambda k: (paying[k], k))
    if current not in prices:
        return best
    if best == current or steps_at_current < cfg.min_dwell:
        return current
    if current not in paying:
        return best
    return best if prices[best] < (1.0 - cfg.margin) * prices[current] else current
