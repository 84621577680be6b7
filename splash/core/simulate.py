"""Paper-scale rollout simulator: a drain workload stepped through the cost model (issue item 7).

All requests arrive at t = 0; their outputs are heavy-tailed, so the batch narrows over time to a
few long requests - the regime change that makes one fixed layout lose somewhere. Each run uses
continuous batching with chunked prefill (a per-step token budget), admission against the KV pool
with the whole input + output reserved (no preemption), owners chosen at admission on projected KV
(least-loaded rank), and an equal per-owner share of the prefill budget. Fixed-layout runs admit
against their own pool; the policy run first admits against the largest pool among its candidates,
then against the pool of the layout it runs, and lets pi(x; theta) pick the layout of every step,
paying Eq 7's exposed time for each switch. Decode-only stretches advance `stride` steps at once, priced at
their midpoint context, which keeps 30k-step runs to a few seconds.

Speculative decoding (`SimConfig.spec_depth` K > 0): decode-only steps verify 1 + k rows per request and
emit the geometric model's expected tokens at acceptance `spec_accept` (splash/core/spec_depth.py),
with k = K (`spec_policy` "always") or the depth that prices cheapest per token for the batch
("auto"; the runtime adds measured corrections, margin and dwell); prefill steps do not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.core.capacity import model_pool_tokens
from splash.core.costmodel import Batch, step_cost
from splash.core.layouts import DEFAULT_PAGE_SIZE, LAYOUTS, Layout, kv_pages_per_rank
from splash.core.model_config import ConfigError
from splash.core.policy import Policy, PolicyConfig, activation_bytes, decide
from splash.core.sizes import AttentionSizes
from splash.core.spec_depth import DepthConfig, draft_seconds, expected_tokens, price_depths
from splash.core.switch_time import switch_time
from splash.core.theta import Theta
from splash.core.transfer import kv_transfer_tokens, switch_layer_bytes, weight_transfer_bytes


@dataclass(frozen=True)
class Workload:
    prompts: np.ndarray
    outputs: np.ndarray

    @classmethod
    def drain(cls, requests: int = 256, prompt_min: int = 2048, prompt_max: int = 8192,
              output_median: int = 2048, output_sigma: float = 1.0, output_max: int = 16384,
              output_min: int = 16, seed: int = 0) -> Workload:
        """Uniform prompts; log-normal (heavy-tailed) outputs clipped to [output_min, output_max]."""
        if requests < 1:
            raise ConfigError(f"--requests must be >= 1, got {requests}")
        if not 1 <= prompt_min <= prompt_max:
            raise ConfigError(f"need 1 <= prompt-min <= prompt-max, got {prompt_min}, {prompt_max}")
        if not 1 <= output_min <= output_max or output_median < 1 or output_sigma < 0:
            raise ConfigError("output lengths must be positive with min <= max and sigma >= 0")
        rng = np.random.default_rng(seed)
        prompts = rng.integers(prompt_min, prompt_max + 1, size=requests)
        outputs = np.exp(rng.normal(np.log(output_median), output_sigma, size=requests))
        outputs = np.clip(np.round(outputs), output_min, output_max).astype(np.int64)
        return cls(prompts.astype(np.int64), outputs)

    @property
    def size(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class SimConfig:
    token_budget: int = 8192  # prefill + decode rows per step (chunked prefill)
    max_running: int = 256
    stride: int = 16  # decode-only steps simulated at once
    page_size: int = DEFAULT_PAGE_SIZE
    spec_depth: int = 0  # K: drafts per verify (0: no speculative decoding)
    spec_accept: float = 0.7  # per-draft acceptance
    spec_policy: str = "auto"  # "auto": the cheapest depth per token each step; "always": K
    spec_draft_layers: int = 0  # MTP layers the drafts run through (0: n-gram, free)

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_running < 1 or self.stride < 1 or self.page_size < 1:
            raise ConfigError("token budget, max running, stride and page size must all be >= 1")
        if self.spec_depth < 0 or not 0 <= self.spec_accept <= 1 \
                or self.spec_policy not in ("auto", "always"):
            raise ConfigError("speculation: depth >= 0, acceptance in [0, 1], policy auto or always")


@dataclass
class RolloutResult:
    name: str
    makespan_s: float = 0.0
    steps: int = 0
    output_tokens: float = 0  # (expected tokens: fractional with speculation)
    prompt_tokens: int = 0
    switches: int = 0
    switch_s: float = 0.0
    steps_by_depth: dict[int, int] = field(default_factory=dict)  # decode steps at each speculation depth
    time_by_layout: dict[str, float] = field(default_factory=dict)
    completion_s: list[float] = field(default_factory=list)  # per request, in finishing order
    # (t_start_s, layout, running requests) at each simulated (macro) step
    timeline: list[tuple[float, str, int]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the makespan."""
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def mean_completion_s(self) -> float:
        return float(np.mean(self.completion_s)) if self.completion_s else 0.0

    def segments(self) -> list[dict[str, Any]]:
        """The layout timeline compressed to [start, end) runs."""
        segs: list[dict[str, Any]] = []
        for t, lay, _ in self.timeline:
            if segs and segs[-1]["layout"] == lay:
                continue
            if segs:
                segs[-1]["end_s"] = t
            segs.append({"layout": lay, "start_s": t, "end_s": self.makespan_s})
        return segs

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "makespan_s": self.makespan_s, "throughput_tok_s": self.throughput,
                "steps": self.steps, "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
                "mean_completion_s": self.mean_completion_s,
                "switches": self.switches, "switch_s": self.switch_s, "time_by_layout_s": self.time_by_layout,
                "steps_by_depth": self.steps_by_depth,
                "segments": self.segments()}


def kv_pool_tokens(layout: Layout, sizes: AttentionSizes, theta: Theta, rows: int) -> int:
    """Per-rank KV tokens a layout can admit: budget - M0 - W(l) - reserve - activations of `rows`."""
    T = theta.ranks
    act = activation_bytes(layout, sizes, Batch.make([rows], [rows], [0], T), T, theta.act_bytes).max()
    return model_pool_tokens(layout, sizes, theta.memory_bytes, T, theta.reserve_bytes + act)


class _Run:
    """Mutable state of one rollout."""

    def __init__(self, wl: Workload, ranks: int) -> None:
        n = wl.size
        self.prompt, self.output = wl.prompts.copy(), wl.outputs.copy()
        self.done_prompt = np.zeros(n, dtype=np.int64)  # prompt tokens already in the cache
        self.generated = np.zeros(n, dtype=np.float64)  # (fractional: expected tokens of verify steps)
        self.owner = np.zeros(n, dtype=np.int64)
        self.running: list[int] = []
        self.waiting: list[int] = list(range(n))
        self.finished = 0
        self.ranks = ranks

    def reserved(self, idx: list[int]) -> np.ndarray:
        return (self.prompt[idx] + self.output[idx]).astype(np.int64)


def _admit(run: _Run, layout: Layout, pool: int, cfg: SimConfig) -> None:
    """FCFS admission with the whole input + output reserved; owners on projected KV."""
    T, P = run.ranks, cfg.page_size
    while run.waiting and len(run.running) < cfg.max_running:
        i = run.waiting[0]
        load = np.bincount(run.owner[run.running], weights=run.reserved(run.running), minlength=T)
        run.owner[i] = int(np.argmin(load))
        cand = run.running + [i]
        pages = kv_pages_per_rank(layout, run.reserved(cand), run.owner[cand], T, P)
        if pages.max(initial=0) * P > pool:
            if not run.running:
                raise ConfigError(f"request {i} ({run.prompt[i]}+{run.output[i]} tokens) never fits the "
                                  f"{layout.label} KV pool of {pool} tokens per rank; give more memory")
            return
        run.running.append(i)
        run.waiting.pop(0)


def _plan_step(run: _Run, cfg: SimConfig) -> tuple[list[int], np.ndarray, int]:
    """This step's rows: 1 per decoding request, prefill chunks from the leftover token budget.

    Returns (requests, rows per request, steps to advance): decode-only batches stride.
    """
    idx = list(run.running)
    rows = np.ones(len(idx), dtype=np.int64)
    prefilling = [k for k, i in enumerate(idx) if run.done_prompt[i] < run.prompt[i]]
    if not prefilling:
        left = run.output[idx] - run.generated[idx]
        return idx, rows, int(min(cfg.stride, left.min()))
    # Each owner schedules its own prefill chunks from an equal share of the budget (as DP-attention
    # servers run one scheduler per rank); under TP/CP only the total matters, so this is neutral.
    T = run.ranks
    budget = np.full(T, (cfg.token_budget - (len(idx) - len(prefilling))) // T, dtype=np.int64)
    for k in prefilling:
        i = idx[k]
        o = run.owner[i]
        take = int(min(max(budget[o], 0), run.prompt[i] - run.done_prompt[i]))
        rows[k] = take
        budget[o] -= take
    if not rows.any():  # budget smaller than T: give the first prefill one row so the run advances
        rows[prefilling[0]] = 1
    return idx, rows, 1  # requests left without budget keep rows = 0 but still hold their KV


def rollout(sizes: AttentionSizes, theta: Theta, wl: Workload, mode: Layout | str,
            cfg: SimConfig = SimConfig(), policy_cfg: PolicyConfig = PolicyConfig(),
            initial: Layout = Layout.TP) -> RolloutResult:
    """Run the drain workload in one fixed layout, or with the policy (`mode="policy"`)."""
    T = theta.ranks
    sizes.cfg.check_ranks(T)
    use_policy = isinstance(mode, str) and mode.lower() == "policy"
    layout = initial if use_policy else Layout.parse(mode)
    cands = policy_cfg.layouts if use_policy else (layout,)
    pools = {lay: kv_pool_tokens(lay, sizes, theta, cfg.token_budget) for lay in cands}
    widest = max(cands, key=lambda lay: pools[lay] * (1 if lay is Layout.TP else T))
    policy = Policy(sizes, theta, PolicyConfig(policy_cfg.margin, policy_cfg.min_dwell, tuple(cands),
                                               cfg.page_size), initial=layout) if use_policy else None
    res = RolloutResult("policy" if use_policy else layout.label)
    res.time_by_layout = {lay.label: 0.0 for lay in LAYOUTS}
    run = _Run(wl, T)
    t = 0.0
    first = True
    while run.finished < wl.size:
        # Admission checks the pages free in the layout that runs now (the first batch: the widest),
        # so a policy run grows its batch only after moving into a roomier layout.
        admit = widest if first and policy is not None else layout
        _admit(run, admit, pools[admit], cfg)
        idx, rows, k = _plan_step(run, cfg)
        start = run.done_prompt[idx] + run.generated[idx]
        decoding = run.done_prompt[idx] >= run.prompt[idx]
        mid = start + np.where(decoding, (k + 1) // 2, rows)  # context incl. this step's rows
        batch = Batch(mid.astype(np.int64), rows, run.owner[idx], run.reserved(idx))
        if policy is not None:
            if first:  # the first step picks where to start; no switch is paid
                policy.current = decide(sizes, theta, batch, None, 0, policy.config).layout
                layout = policy.current
                first = False
            else:
                before = policy.current
                d = policy.step(batch, k)
                if d.switch:
                    cost_b = step_cost(d.layout, sizes, batch, theta, cfg.page_size)
                    if sizes.cfg.is_hybrid:  # KDA layers: their projections and per-request states
                        w2, kv2 = switch_layer_bytes(sizes, before, d.layout, start, run.owner[idx], None, T,
                                                     cfg.page_size)
                        exposed, _ = switch_time(w2, kv2, cost_b, theta)
                    else:
                        w = weight_transfer_bytes(sizes, before, d.layout, T)
                        kv_tok, _ = kv_transfer_tokens(before, d.layout, start, run.owner[idx], None, T,
                                                       cfg.page_size)
                        exposed, _ = switch_time(w, np.outer(sizes.kv_layer_bytes, kv_tok), cost_b, theta)
                    t += exposed
                    res.switch_s += exposed
                    res.switches += 1
            layout = policy.current
        per_step = 1.0  # tokens a decoding request emits per step
        if cfg.spec_depth and decoding.all():
            d, per_step, batch, k = _speculate(sizes, theta, layout, run, idx, start, cfg)
            dt = (step_cost(layout, sizes, batch, theta, cfg.page_size).total
                  + draft_seconds(step_cost(layout, sizes, Batch(batch.contexts, np.ones_like(batch.rows),
                                                                 batch.owners), theta).total, d,
                                  DepthConfig(max(1, cfg.spec_depth), draft_layers=cfg.spec_draft_layers),
                                  sizes)) * k
            res.steps_by_depth[d] = res.steps_by_depth.get(d, 0) + k
        else:
            dt = step_cost(layout, sizes, batch, theta, cfg.page_size).total * k
        res.timeline.append((t, layout.label, len(run.running)))
        t += dt
        res.time_by_layout[layout.label] += dt
        res.steps += k
        # advance state
        pre = ~decoding
        run.done_prompt[np.asarray(idx)[pre]] += rows[pre]
        finishing_prefill = pre & (run.done_prompt[idx] >= run.prompt[idx])
        # (the last prefill chunk samples one token)
        gen = np.where(decoding, k * per_step, np.where(finishing_prefill & (rows > 0), 1, 0))
        gen = np.minimum(gen, run.output[idx] - run.generated[idx])
        run.generated[idx] += gen
        res.output_tokens += float(gen.sum())
        res.prompt_tokens += int(rows[pre].sum())
        done = {i for i in idx if run.generated[i] >= run.output[i]}
        if done:
            run.running = [i for i in run.running if i not in done]
            run.finished += len(done)
            res.completion_s.extend([t] * len(done))
    res.makespan_s = t
    return res


def _speculate(sizes: AttentionSizes, theta: Theta, layout: Layout, run: _Run, idx: list[int],
               start: np.ndarray, cfg: SimConfig) -> tuple[int, float, Batch, int]:
    """A decode-only stretch with speculation: (depth, tokens per request per step, the verify batch,
    steps to advance)."""
    K, a = cfg.spec_depth, cfg.spec_accept
    dcfg = DepthConfig(K, draft_layers=cfg.spec_draft_layers)
    if cfg.spec_policy == "always":
        d = K
    else:
        prices = price_depths(sizes, theta, layout, start, [a] * len(idx), dcfg, owners=run.owner[idx])
        d = min(prices, key=lambda j: (prices[j], j))
    per = float(expected_tokens(a, d))
    left = run.output[idx] - run.generated[idx]
    k = int(max(1, min(cfg.stride, np.ceil(left.min() / per))))
    rows = np.full(len(idx), d + 1, dtype=np.int64)
    mid = start + rows + (k * per) // 2
    return d, per, Batch(mid.astype(np.int64), rows, run.owner[idx], run.reserved(idx)), k


def rollout_all(sizes: AttentionSizes, theta: Theta, wl: Workload, cfg: SimConfig = SimConfig(),
                policy_cfg: PolicyConfig = PolicyConfig(),
                layouts: tuple[Layout, ...] = LAYOUTS) -> dict[str, RolloutResult]:
    """Every fixed layout that can hold the workload, then the policy; with `cfg.spec_depth`, the policy
    also with speculation by the depth policy (`policy+spec`) and always at full depth
    (`policy+spec-always`), the others without."""
    import dataclasses

    base = dataclasses.replace(cfg, spec_depth=0)
    out: dict[str, RolloutResult] = {}
    for lay in layouts:
        try:
            out[lay.label] = rollout(sizes, theta, wl, lay, base, policy_cfg)
        except ConfigError as e:
            r = RolloutResult(lay.label, makespan_s=float("inf"))
            r.timeline = [(0.0, f"infeasible: {e}", 0)]
            out[lay.label] = r
    pcfg = PolicyConfig(policy_cfg.margin, policy_cfg.min_dwell, layouts, cfg.page_size)
    out["policy"] = rollout(sizes, theta, wl, "policy", base, pcfg)
    if cfg.spec_depth:
        for name, mode in (("policy+spec", "auto"), ("policy+spec-always", "always")):
            out[name] = rollout(sizes, theta, wl, "policy", dataclasses.replace(cfg, spec_policy=mode), pcfg)
            out[name].name = name
    return out


def plot_rollouts(results: dict[str, RolloutResult], path: str, title: str = "") -> None:
    """Running requests over time per run, the policy's layout as a coloured band, makespans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"TP": "tab:blue", "DP": "tab:orange", "CP": "tab:green", "DOP": "tab:red", "policy": "black"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    for name, r in results.items():
        if not r.timeline or not np.isfinite(r.makespan_s):
            continue
        ts = [p[0] for p in r.timeline] + [r.makespan_s]
        ys = [p[2] for p in r.timeline] + [0]
        ax.step(ts, ys, where="post", color=colors.get(name, "gray"), label=name,
                lw=2 if name == "policy" else 1)
    pol = results.get("policy")
    if pol is not None:
        for seg in pol.segments():
            ax.axvspan(seg["start_s"], seg["end_s"], ymin=0.97, ymax=1.0, color=colors.get(seg["layout"]))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("running requests")
    ax.set_title(title or "Drain rollout (band on top: policy's layout)")
    ax.legend()
    ax.grid(alpha=0.3)
    names = [n for n, r in results.items() if np.isfinite(r.makespan_s)]
    bx.bar(names, [results[n].makespan_s for n in names], color=[colors.get(n, "gray") for n in names])
    bx.set_ylabel("makespan (s)")
    bx.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
