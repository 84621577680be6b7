"""KV capacity: pool sizes per layout from a memory budget, and the cohort-residency limits (App. B.1).

A layout's per-rank KV pool is what the budget leaves after its attention weights (W_A/T sharded,
W_A replicated) and the reserve. How long a nominal input each layout sustains then depends on how
histories land on ranks, which is random: appendix B.1 samples cohorts of B requests with inputs
uniform on the integers [floor(L/2), L] and outputs uniform on [512, 1024], reserves the whole
input + output KV, and calls L feasible when every rank fits in at least 99% of cohorts. DP/DOP
owners are count-balanced round-robin (request i on rank i mod T, length-blind), CP is ideally
token-balanced, TP replicates every history. The sample is redrawn with the same PCG64 seed at
every candidate L, as one run of the protocol at that L, and L is bisected to the token.

A hybrid (SPEC §10) also limits *requests*: each admitted request holds z bytes of KDA state whatever
its context, of which a rank keeps the share g of `Layout.state_placement` (1/T head-sharded, whole on
a DP owner, whole on every CP rank). `model_capacity` gives per layout the state slots (requests with
no context), the token pool with no request, and the requests of a given context that fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from splash.core.layouts import (
    LAYOUTS,
    Layout,
    Ownership,
    StatePlacement,
    check_batch,
    kv_histories_busiest,
    kv_tokens_per_rank,
    state_histories_busiest,
    state_requests_per_rank,
)
from splash.core.model_config import ConfigError
from splash.core.sizes import GIB, KIB, AttentionSizes

PAPER_SEED = 20260922
PAPER_COHORTS = 200_000
PAPER_RESIDENCY = 0.99
K = 1024  # the paper's "1k": limits and crossovers are reported in units of 1024 tokens


def footprint(layout: Layout, sizes: AttentionSizes, contexts: Sequence[int],
              owners: Sequence[int] | None, ranks: int, page_size: int | None = None) -> np.ndarray:
    """Eq 1 for any batch: per-rank bytes of attention weights + KV + per-request state ([T] float
    array): M(l) = W(l) + B*k*s*f_l + B*z*g_l. A DSA model's indexer projections count whole on every
    rank, its indexer keys in k; a hybrid's KDA projections shard like MLA's, its states by g."""
    s, o = check_batch(contexts, owners, ranks)
    kv = kv_tokens_per_rank(layout, s, o, ranks, page_size) * sizes.k
    w = np.array([sizes.attention_weight_bytes(layout.sharded, ranks, r) for r in range(ranks)])
    if sizes.z:
        return w + kv + state_requests_per_rank(layout, o, ranks) * sizes.z
    return w + kv


def pool_tokens(layout: Layout, memory_bytes: float, w_a: float, k: float, ranks: int,
                reserve_bytes: float = 0.0) -> int:
    """Per-rank KV pool in tokens: (budget - layout's attention weights - reserve) / k, floored."""
    if k <= 0:
        raise ConfigError(f"KV bytes per token must be > 0, got {k}")
    if memory_bytes < 0 or w_a < 0 or reserve_bytes < 0:
        raise ConfigError("memory, weights and reserve must be >= 0")
    w = w_a / ranks if layout.sharded else w_a
    return max(0, math.floor((memory_bytes - w - reserve_bytes) / k))


def pools_from_budget(memory_bytes: float, w_a: float, k: float, ranks: int,
                      reserve_bytes: float = 0.0) -> dict[Layout, int]:
    return {lay: pool_tokens(lay, memory_bytes, w_a, k, ranks, reserve_bytes) for lay in LAYOUTS}


def model_free_bytes(layout: Layout, sizes: AttentionSizes, memory_bytes: float, ranks: int,
                     reserve_bytes: float = 0.0, fixed: bool = True) -> float:
    """Bytes per rank left for KV and per-request state: budget - M0 (when `fixed`) - W_r(l) - reserve."""
    used = sizes.attention_weight_bytes(layout.sharded, ranks) + reserve_bytes
    if fixed:
        used += sizes.fixed_bytes_per_rank(ranks)
    return memory_bytes - used


def model_pool_tokens(layout: Layout, sizes: AttentionSizes, memory_bytes: float, ranks: int,
                      reserve_bytes: float = 0.0, fixed: bool = True, requests: int = 0) -> int:
    """Per-rank KV pool of a model in tokens: (budget - M0 (when `fixed`) - W_r(l) - reserve - the
    busiest rank's share of `requests` request states) / k, floored.

    W_r(l) and k are the model's (`AttentionSizes`): rank 0's head slice or every head, a DSA model's
    indexer projections whole in either, and its indexer keys and the KV dtype's layout in k; a hybrid's
    KDA projections shard alike and only its MLA layers count in k. The one pool rule the policy, the
    simulator and `splash plan capacity --model` ask."""
    free = model_free_bytes(layout, sizes, memory_bytes, ranks, reserve_bytes, fixed)
    if requests and sizes.z:
        free -= state_histories_busiest(layout, requests, ranks) * sizes.z
    return max(0, math.floor(free / sizes.k))


def state_slots(layout: Layout, sizes: AttentionSizes, memory_bytes: float, ranks: int,
                reserve_bytes: float = 0.0, fixed: bool = True) -> int | None:
    """Requests the group can hold by their per-request state alone (no context), from the free bytes F
    per rank: head-sharded floor(T*F/z), DP T*floor(F/z) (whole states per owner), CP floor(F/z). None
    for a model without per-request state (no such limit)."""
    z = sizes.z
    if not z:
        return None
    free = max(0.0, model_free_bytes(layout, sizes, memory_bytes, ranks, reserve_bytes, fixed))
    kind = layout.state_placement
    if kind is StatePlacement.HEAD_SHARDED:
        return math.floor(free * ranks / z)
    if kind is StatePlacement.OWNER:
        return ranks * math.floor(free / z)
    return math.floor(free / z)


def busiest_request_bytes(layout: Layout, sizes: AttentionSizes, batch: int, context: float,
                          ranks: int) -> float:
    """KV + state bytes on the busiest rank for `batch` requests of `context` tokens (count-balanced
    owners, ideal CP): Eq 1's B*k*s*f + B*z*g without the weights."""
    if batch <= 0:
        return 0.0
    kv = kv_histories_busiest(layout, batch, ranks) * sizes.k * context
    return kv + state_histories_busiest(layout, batch, ranks) * sizes.z


def requests_at(layout: Layout, sizes: AttentionSizes, memory_bytes: float, ranks: int, context: int,
                reserve_bytes: float = 0.0, fixed: bool = True, limit: int = 1 << 40) -> int:
    """Most requests of `context` tokens each the group holds in `layout` (KV and, in a hybrid, state):
    the largest B whose busiest rank fits; `limit` when nothing per request costs memory."""
    free = model_free_bytes(layout, sizes, memory_bytes, ranks, reserve_bytes, fixed)
    if free < 0:
        return 0
    if sizes.k * context <= 0 and not sizes.z:
        return limit
    lo, hi = 0, 1
    while hi < limit and busiest_request_bytes(layout, sizes, hi, context, ranks) <= free:
        lo, hi = hi, hi * 2
    hi = min(hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if busiest_request_bytes(layout, sizes, mid, context, ranks) <= free:
            lo = mid
        else:
            hi = mid
    return hi if busiest_request_bytes(layout, sizes, hi, context, ranks) <= free else lo


@dataclass(frozen=True)
class Capacity:
    """One layout's capacity from a memory budget: per-rank KV pool with no request (`tokens`), the
    requests its state slots hold (`requests`: None without per-request state), and the requests of
    `context` tokens that fit (`requests_at_context`, when a context was asked)."""

    layout: Layout
    tokens: int
    requests: int | None
    context: int | None = None
    requests_at_context: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"layout": self.layout.label, "pool_tokens_per_rank": self.tokens,
                "state_slots": self.requests, "context": self.context,
                "requests_at_context": self.requests_at_context}


def model_capacity(sizes: AttentionSizes, memory_bytes: float, ranks: int, reserve_bytes: float = 0.0,
                   fixed: bool = True, context: int | None = None) -> dict[Layout, Capacity]:
    """Capacity in tokens and requests of every layout (see `Capacity`)."""
    out = {}
    for lay in LAYOUTS:
        at = None if context is None else requests_at(lay, sizes, memory_bytes, ranks, context,
                                                      reserve_bytes, fixed)
        out[lay] = Capacity(lay, model_pool_tokens(lay, sizes, memory_bytes, ranks, reserve_bytes, fixed),
                            state_slots(lay, sizes, memory_bytes, ranks, reserve_bytes, fixed), context, at)
    return out


def model_pools(sizes: AttentionSizes, memory_bytes: float, ranks: int, reserve_bytes: float = 0.0,
                fixed: bool = True, requests: int = 0) -> dict[Layout, int]:
    """`model_pool_tokens` of every layout (`requests`: the per-request states held beside the pool)."""
    return {lay: model_pool_tokens(lay, sizes, memory_bytes, ranks, reserve_bytes, fixed, requests)
            for lay in LAYOUTS}


def distinct_tokens(layout: Layout, pool: int, ranks: int) -> int:
    """Distinct tokens a group of `ranks` equal pools stores (`Layout.distinct`: TP's replicas count
    once, the other layouts' pools add up)."""
    return layout.distinct([pool] * ranks)


@dataclass(frozen=True)
class CapacityScenario:
    """A batch B on T ranks with a per-rank token pool per layout (appendix B.1's scenarios)."""

    name: str
    batch: int
    ranks: int
    pools: dict[Layout, int]
    output_min: int = 512
    output_max: int = 1024
    note: str = ""
    paper_limits_k: dict[Layout, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.ranks < 1:
            raise ConfigError(f"batch and ranks must be >= 1, got B={self.batch}, T={self.ranks}")
        if not 0 <= self.output_min <= self.output_max:
            raise ConfigError(f"output range [{self.output_min}, {self.output_max}] is empty or negative")
        for lay, p in self.pools.items():
            if p < 0:
                raise ConfigError(f"{lay.label} pool must be >= 0 tokens, got {p}")


def dcu_scenario() -> CapacityScenario:
    """GLM-5.3-Flash on BW1000: 52.8 GiB per rank for attention weights + latent KV (the 1 GiB
    transient reserve is separate, outside that budget), 24 GiB full attention weights,
    64 KiB KV per token, B=16, T=8."""
    pools = pools_from_budget(52.8 * GIB, 24 * GIB, 64 * KIB, 8)
    return CapacityScenario("dcu", 16, 8, pools, note="52.8 GiB budget, 24 GiB W_A, 64 KiB/token",
                            paper_limits_k={Layout.TP: 58.9, Layout.DP: 232.6, Layout.CP: 275.6,
                                            Layout.DOP: 402.8})


def h200_scenario() -> CapacityScenario:
    """DeepSeek-V3.2 FP8 on H200 (memory fraction 0.90): the paper's per-GPU pools, B=32, T=8."""
    pools = {Layout.TP: 1_000_832, Layout.DP: 686_144, Layout.CP: 724_736, Layout.DOP: 948_352}
    return CapacityScenario("h200", 32, 8, pools, note="per-GPU token pools of appendix B.1",
                            paper_limits_k={Layout.TP: 36.81, Layout.DP: 175.93, Layout.CP: 217.73,
                                            Layout.DOP: 243.48})


def b200_scenario() -> CapacityScenario:
    """GLM-5.3 FP8 on B200 (fraction 0.85): Table 3's pools per GPU, B=16, T=8. Only TP's 75.68k
    is a sampled limit in the paper; its DP/CP/DOP limits (400k/450k/512k) are prescribed."""
    pools = {Layout.TP: 1_045_312, Layout.DP: 6_497_792 // 8, Layout.CP: 6_738_944 // 8,
             Layout.DOP: 8_271_360 // 8}
    return CapacityScenario("b200", 16, 8, pools, note="Table 3 pools; paper samples TP only",
                            paper_limits_k={Layout.TP: 75.68})


SCENARIOS = {"dcu": dcu_scenario, "h200": h200_scenario, "b200": b200_scenario}


def scenario(name: str) -> CapacityScenario:
    try:
        return SCENARIOS[name.lower()]()
    except KeyError:
        choices = ", ".join(SCENARIOS)
        raise ConfigError(f"unknown capacity scenario {name!r}; choose one of {choices}") from None


# ---- the cohort simulation ------------------------------------------------------------------------
def _draw(nominal: int, sc: CapacityScenario, cohorts: int, seed: int) -> np.ndarray:
    """[cohorts, B] reserved tokens (input + output) of one protocol run at nominal input L."""
    rng = np.random.Generator(np.random.PCG64(seed))
    inp = rng.integers(nominal // 2, nominal + 1, size=(cohorts, sc.batch))
    out = rng.integers(sc.output_min, sc.output_max + 1, size=(cohorts, sc.batch))
    return inp + out


def busiest_rank_tokens(layout: Layout, reserved: np.ndarray, ranks: int) -> np.ndarray:
    """[cohorts] tokens on the busiest rank under the appendix's placement assumptions."""
    if layout.ownership is Ownership.REPLICATED:
        return reserved.sum(axis=1)
    if layout.ownership is Ownership.POSITION:
        return -(-reserved.sum(axis=1) // ranks)
    per_rank = np.stack([reserved[:, r::ranks].sum(axis=1) for r in range(ranks)], axis=1)
    return per_rank.max(axis=1)


def residency(nominal: int, sc: CapacityScenario, layouts: tuple[Layout, ...] = LAYOUTS,
              cohorts: int = PAPER_COHORTS, seed: int = PAPER_SEED) -> dict[Layout, float]:
    """Fraction of cohorts in which every rank fits, per layout, at nominal input `nominal`."""
    reserved = _draw(nominal, sc, cohorts, seed)
    return {lay: float((busiest_rank_tokens(lay, reserved, sc.ranks) <= sc.pools[lay]).mean())
            for lay in layouts}


def _guess(layout: Layout, sc: CapacityScenario, target: float) -> int:
    """Normal approximation of the limit, to start the bracket near the answer."""
    T, B = sc.ranks, sc.batch
    if layout.ownership is Ownership.REPLICATED:
        n, pool, q = B, sc.pools[layout], target
    elif layout.ownership is Ownership.POSITION:
        n, pool, q = B, sc.pools[layout] * T, target
    else:
        n, pool, q = math.ceil(B / T), sc.pools[layout], target ** (1 / T)
    z = NormalDist().inv_cdf(min(max(q, 1e-9), 1 - 1e-9))
    o_mean = (sc.output_min + sc.output_max) / 2
    o_var = ((sc.output_max - sc.output_min + 1) ** 2 - 1) / 12
    L = max(pool / n, 1.0)
    for _ in range(50):  # fixed point of n*(0.75L + o) + z*sd(L) = pool
        sd = math.sqrt(n * ((L / 2) ** 2 / 12 + o_var))
        L = max(1.0, (pool - n * o_mean - z * sd) / (0.75 * n))
    return int(L)


def residency_limit(layout: Layout, sc: CapacityScenario, cohorts: int = PAPER_COHORTS,
                    seed: int = PAPER_SEED, target: float = PAPER_RESIDENCY) -> int:
    """Largest nominal input L (tokens) at which all ranks fit in >= `target` of cohorts."""
    if not 0 < target <= 1:
        raise ConfigError(f"residency target must be in (0, 1], got {target}")
    if cohorts < 1:
        raise ConfigError(f"cohorts must be >= 1, got {cohorts}")
    memo: dict[int, bool] = {}

    def ok(L: int) -> bool:
        if L not in memo:
            memo[L] = residency(L, sc, (layout,), cohorts, seed)[layout] >= target
        return memo[L]

    if not ok(1):
        return 0
    if cohorts >= 50_000:  # a cheap pass on a tenth of the cohorts starts the bracket close by
        g = max(2, residency_limit(layout, sc, cohorts // 10, seed, target))
        first = max(16, g // 400)
    else:
        g = max(2, _guess(layout, sc, target))
        first = max(16, g // 100)
    step = first
    lo, hi = g, g
    while not ok(lo):  # walk down until feasible
        hi, lo = lo, max(1, lo - step)
        step *= 2
    step = first
    while ok(hi):  # walk up until infeasible
        lo, hi = hi, hi + step
        step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def residency_limits(sc: CapacityScenario, cohorts: int = PAPER_COHORTS, seed: int = PAPER_SEED,
                     target: float = PAPER_RESIDENCY) -> dict[Layout, int]:
    return {lay: residency_limit(lay, sc, cohorts, seed, target) for lay in LAYOUTS}
