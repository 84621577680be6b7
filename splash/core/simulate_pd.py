"""`splash simulate pd`: a prefill group of a disaggregated (1P1D) deployment stepped through the cost
model, its finished prompts sent over the link to the decode group, per fixed prefill layout and with
`auto` (issue 47; the paper's Figure 10).

The prefill server: requests arrive, are admitted FCFS against its KV pool (the prompt reserved until
its transfer ends), get owners on projected KV (least loaded), and are prefilled in chunks of a per-step
token budget: each owner's equal share first, the rest in prompt order (the same rows in every layout,
so `auto` compares layouts on one batch). A step costs Eq 10 (`costmodel.step_cost`). A prompt
that completes is sent at once: its transfer (`pd_cost.request_link`: the manifest's bytes on each
prefill and decode rank-link) queues behind earlier ones on the links it uses and ends at
start + busiest link's bytes / `pd_bw` + `pd_link_lat`; the request's time to first token (TTFT) is
that end minus its arrival (the decode's first token follows at once; its decode group, the same for
every prefill layout, is not simulated). `auto` lets `policy.decide(..., pd=dest)` choose the layout of
every step on step time plus the finishing requests' transfer, paying Eq 7's exposed switch time.

Figure 10 (appendix I: DeepSeek-V3.2 on H200, prefill layout varied, decode DP-attention) measures total
throughput B(L_in + 1024) / T_batch, T_batch = queueing + prefill + transfer + decode. Decode is the same
for every prefill layout, so the fastest prefill layout is the one whose batch reaches its last first
token soonest: that is what is compared with the paper's label at each sampled position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.core.costmodel import Batch, step_cost
from splash.core.layouts import LAYOUTS, PAPER_PAGE_SIZE, Layout, kv_pages_per_rank
from splash.core.model_config import ConfigError
from splash.core.pd import Group
from splash.core.pd_cost import PDDest, request_link
from splash.core.policy import PolicyConfig, decide
from splash.core.simulate import kv_pool_tokens
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

K = 1024
# Figure 10 / Table 6 of the paper (H200, DeepSeek-V3.2, 1P1D, 1,024 output tokens): per sampled position
# (sweep, B, input tokens) the measured total throughput in 10^3 tokens/s of TP, CP, DP-attention, DOP as
# the prefill layout. The label at a position is its best; the runner-up's gap says how decisive it is.
PAPER_FIG10: tuple[tuple[str, int, int, tuple[float, float, float, float]], ...] = (
    ("input B=16", 16, 1 * K, (0.937, 0.885, 0.930, 0.864)),
    ("input B=16", 16, 4 * K, (1.994, 2.080, 2.232, 2.071)),
    ("input B=16", 16, 16 * K, (5.037, 6.267, 6.441, 5.996)),
    ("input B=16", 16, 32 * K, (6.300, 10.512, 10.137, 9.185)),
    ("input B=16", 16, 64 * K, (7.700, 13.279, 11.820, 11.676)),
    ("input B=16", 16, 128 * K, (6.596, 17.457, 11.101, 14.978)),
    ("input B=16", 16, 256 * K, (5.847, 13.119, 10.265, 14.349)),
    ("input B=32", 32, 1 * K, (1.769, 1.680, 1.667, 1.598)),
    ("input B=32", 32, 4 * K, (3.612, 3.842, 3.964, 3.867)),
    ("input B=32", 32, 16 * K, (6.782, 10.880, 11.069, 8.985)),
    ("input B=32", 32, 32 * K, (7.955, 13.913, 11.900, 12.064)),
    ("input B=32", 32, 64 * K, (8.177, 20.386, 14.402, 19.170)),
    ("input B=32", 32, 128 * K, (6.225, 16.843, 14.567, 18.584)),
    ("input B=32", 32, 256 * K, (5.935, 16.488, 14.026, 17.186)),
    ("batch 32K", 1, 32 * K, (1.054, 0.972, 0.824, 0.927)),
    ("batch 32K", 4, 32 * K, (3.320, 3.234, 3.212, 3.132)),
    ("batch 32K", 8, 32 * K, (4.971, 5.932, 6.208, 6.044)),
    ("batch 32K", 16, 32 * K, (6.584, 10.321, 10.681, 9.104)),
    ("batch 32K", 32, 32 * K, (7.748, 15.643, 11.287, 11.977)),
    ("batch 32K", 64, 32 * K, (7.920, 18.032, 13.949, 17.245)),
    ("batch 32K", 128, 32 * K, (6.766, 18.600, 14.143, 19.743)),
    ("batch 32K", 256, 32 * K, (6.704, 18.391, 13.399, 19.466)),
    ("batch 64K", 1, 64 * K, (1.784, 2.232, 1.598, 1.477)),
    ("batch 64K", 4, 64 * K, (4.450, 5.296, 5.118, 5.147)),
    ("batch 64K", 8, 64 * K, (6.190, 10.050, 10.484, 8.396)),
    ("batch 64K", 16, 64 * K, (7.109, 13.466, 11.891, 12.121)),
    ("batch 64K", 32, 64 * K, (7.365, 16.378, 15.190, 14.522)),
    ("batch 64K", 64, 64 * K, (7.261, 16.169, 14.651, 17.846)),
    ("batch 64K", 128, 64 * K, (6.734, 16.103, 13.736, 18.054)),
)
PAPER_ORDER = (Layout.TP, Layout.CP, Layout.DP, Layout.DOP)  # Table 6's column order


@dataclass(frozen=True)
class PDSimConfig:
    token_budget: int = 8192  # prefill rows per step (SGLang's default chunked prefill size)
    page_size: int = PAPER_PAGE_SIZE

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.page_size < 1:
            raise ConfigError("token budget and page size must be >= 1")


@dataclass
class PrefillRun:
    """One prefill run: per request its time to first token (transfer included), and the totals."""

    name: str
    ttft_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    makespan_s: float = 0.0  # the last transfer's end
    steps: int = 0
    switches: int = 0
    switch_s: float = 0.0
    link_bytes: int = 0
    time_by_layout: dict[str, float] = field(default_factory=dict)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (start, layout) of each change
    error: str = ""  # why the run could not hold its workload (then every time is inf)

    @property
    def ok(self) -> bool:
        return not self.error

    def to_dict(self) -> dict[str, Any]:
        if not self.ok:
            return {"name": self.name, "error": self.error}
        t = self.ttft_s
        return {"name": self.name, "makespan_s": self.makespan_s, "mean_ttft_s": float(t.mean()),
                "p50_ttft_s": float(np.percentile(t, 50)), "p99_ttft_s": float(np.percentile(t, 99)),
                "steps": self.steps, "switches": self.switches, "switch_s": self.switch_s,
                "link_bytes": self.link_bytes, "time_by_layout_s": self.time_by_layout,
                "timeline": [[s, lay] for s, lay in self.timeline]}


def prefill_run(sizes: AttentionSizes, theta: Theta, dest: PDDest, prompts: np.ndarray, arrivals: np.ndarray,
                mode: Layout | str, cfg: PDSimConfig = PDSimConfig(),
                policy_cfg: PolicyConfig | None = None) -> PrefillRun:
    """Prefill `prompts` (arriving at `arrivals` seconds) in one fixed layout or `mode="auto"` (the
    policy, `policy_cfg.layouts` its candidates), sending each to `dest`; see the module's docstring."""
    T, P, n = theta.ranks, cfg.page_size, len(prompts)
    sizes.cfg.check_ranks(T)
    prompts, arrivals = np.asarray(prompts, dtype=np.int64), np.asarray(arrivals, dtype=float)
    if prompts.shape != arrivals.shape or n == 0 or (prompts < 1).any():
        raise ConfigError("need one arrival per prompt and prompts of at least one token")
    auto = isinstance(mode, str) and mode.lower() == "auto"
    pcfg = policy_cfg or PolicyConfig(page_size=P)
    pcfg = PolicyConfig(pcfg.margin, pcfg.min_dwell, pcfg.layouts, P)
    layout = None if auto else Layout.parse(mode)
    cands = pcfg.layouts if auto else (layout,)
    pools = {lay: kv_pool_tokens(lay, sizes, theta, cfg.token_budget) for lay in cands}
    res = PrefillRun("auto" if auto else layout.label, np.full(n, np.inf))
    res.time_by_layout = {lay.label: 0.0 for lay in LAYOUTS}
    waiting = deque(int(i) for i in np.argsort(arrivals, kind="stable"))
    done = np.zeros(n, dtype=np.int64)
    owner = np.zeros(n, dtype=np.int64)
    running: list[int] = []  # admitted, prompt not finished
    sending: list[tuple[float, int]] = []  # (transfer end, request): KV held until then
    link_p, link_d = np.zeros(T), np.zeros(dest.ranks)
    d_next, t, since, finished = 0, 0.0, 0, 0
    while finished < n:
        held = running + [i for end, i in sending if end > t]
        # admission counts the pages of the layout that runs (a fresh auto run: the widest pool)
        admit = layout if layout is not None else max(cands, key=lambda x: pools[x] * (T, 1)[x is Layout.TP])
        while waiting and arrivals[waiting[0]] <= t:
            i = waiting[0]
            load = np.bincount(owner[held], weights=prompts[held], minlength=T) if held else np.zeros(T)
            owner[i] = int(np.argmin(load))
            cand = held + [i]
            if kv_pages_per_rank(admit, prompts[cand], owner[cand], T, P).max() * P > pools[admit]:
                if not held:
                    res.error = (f"a {prompts[i]:,}-token prompt never fits the {admit.label} KV pool of "
                                 f"{pools[admit]:,} tokens per rank")
                    return res
                break
            running.append(i)
            held.append(i)
            waiting.popleft()
        if not running:  # idle: the next arrival, or the next transfer to free its pages
            # (an arrived request that did not fit waits for a transfer to end, not for its own arrival)
            nxt = [end for end, _ in sending if end > t]
            nxt += [arrivals[waiting[0]]] if waiting and arrivals[waiting[0]] > t else []
            t = min(nxt)
            continue
        rows = _rows(running, prompts, done, owner, T, cfg.token_budget)
        idx = np.asarray(running)
        batch = Batch(done[idx] + rows, rows, owner[idx], prompts[idx])
        fin = done[idx] + rows >= prompts[idx]
        if auto:
            d = decide(sizes, theta, batch, layout, since, pcfg, pd=dest, finishing=fin)
            if layout is not None and d.switch:
                res.switches += 1
                res.switch_s += d.evals[d.layout].switch_exposed_s
                t += d.evals[d.layout].switch_exposed_s
                since = 0
            if d.layout is not layout:
                res.timeline.append((t, d.layout.label))
                layout = d.layout
        elif not res.timeline:
            res.timeline.append((t, layout.label))
        act = rows > 0
        dt = step_cost(layout, sizes, Batch(batch.contexts[act], rows[act], owner[idx][act]), theta, P).total
        t += dt
        since += 1
        res.steps += 1
        res.time_by_layout[layout.label] += dt
        done[idx] += rows
        for i in idx[fin].tolist():
            src = Group(layout, T, int(owner[i]) if layout.owned else 0)
            dst = Group(dest.layout, dest.ranks, d_next % dest.ranks if dest.layout.owned else 0)
            d_next += 1
            send, recv = request_link(sizes, src, dst, int(prompts[i]), P, dest.fill)
            ps, pr = send > 0, recv > 0
            start = max([t, *link_p[ps], *link_d[pr]])
            end = start + max(send.max(initial=0), recv.max(initial=0)) / theta.pd_bw + theta.pd_link_lat
            link_p[ps] = end
            link_d[pr] = end
            res.link_bytes += int(send.sum())
            res.ttft_s[i] = end - arrivals[i]
            sending.append((end, i))
            finished += 1
        running = [i for i in running if done[i] < prompts[i]]
        sending = [(end, i) for end, i in sending if end > t]
    res.makespan_s = float((res.ttft_s + arrivals).max())
    return res


def _rows(running: list[int], prompts: np.ndarray, done: np.ndarray, owner: np.ndarray, T: int,
          budget: int) -> np.ndarray:
    """This step's prefill rows per running request, the same for every layout (so the policy compares
    layouts on one batch): each owner's equal share of the budget first (attention-DP balances its
    ranks), then what is left in prompt order (work-conserving: an owner without prompts lends its share)."""
    rows = np.zeros(len(running), dtype=np.int64)
    share = np.full(T, budget // T, dtype=np.int64)
    for k, i in enumerate(running):
        rows[k] = min(share[owner[i]], prompts[i] - done[i])
        share[owner[i]] -= rows[k]
    left = budget - int(rows.sum())
    for k, i in enumerate(running):
        more = int(min(left, prompts[i] - done[i] - rows[k]))
        rows[k] += more
        left -= more
    return rows


# ---- Figure 10 -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Position:
    """One sampled position of Figure 10: the simulated batch TTFT per prefill layout and the labels."""

    sweep: str
    batch: int
    input: int
    ttft_s: dict[str, float]  # per layout (inf: does not fit)
    paper: dict[str, float]  # Table 6: total throughput, 10^3 tok/s
    errors: dict[str, str]

    @property
    def simulated(self) -> str:
        return min(self.ttft_s, key=lambda k: self.ttft_s[k])

    @property
    def name(self) -> str:
        """'input B=16 32K' / 'batch B=64 32K'."""
        return f"{self.sweep.split()[0]} B={self.batch} {self.input // K}K"

    @property
    def label(self) -> str:
        return max(self.paper, key=lambda k: self.paper[k])

    @property
    def agree(self) -> bool:
        return self.simulated == self.label

    @property
    def paper_lead(self) -> float:
        """How far the paper's best led its runner-up (relative throughput)."""
        v = sorted(self.paper.values(), reverse=True)
        return v[0] / v[1] - 1

    @property
    def sim_gap(self) -> float:
        """How much slower the simulation says the paper's label is than the simulated best."""
        return self.ttft_s[self.label] / self.ttft_s[self.simulated] - 1

    def reason(self, theta: Theta) -> str:
        """Why the simulation differs here, from what the run shows (empty when it agrees)."""
        if self.agree:
            return ""
        lab, sim = Layout.parse(self.label), Layout.parse(self.simulated)
        if self.label in self.errors:
            return f"{self.label} does not fit here in the simulation ({self.errors[self.label]})"
        why = []
        if self.paper_lead < 0.03:
            why.append(f"the paper's {self.label} leads by only {self.paper_lead:.1%}, a tie (decode, the "
                       "same for every prefill layout, is a large share of its end-to-end time)")
        if lab is Layout.DOP and sim is Layout.CP:
            why.append("Eq 10 gives CP's token-split prefill and DOP the same projection and attention work "
                       "per rank (1/T of the rows at all heads, all rows at H/T heads); DOP pays Eq 4's "
                       "exchange where CP gathers its earlier keys and outputs, so DOP leads only where its "
                       "larger KV pool changes admission, which it does not at this position")
        elif lab is Layout.DOP:
            why.append("DOP does DP-attention's attention work plus Eq 4's exchange (a rank's share, "
                       "1/T of the group's total); its sharded projections must win that back")
        elif lab is Layout.TP:
            why.append(f"Eq 10 has TP run the DSA indexer for every row on every rank ({theta.ranks}x, as "
                       "SGLang's TP does) beside an all-reduce, which CP's token split and DP-attention do "
                       "not pay; what gives TP the paper's lead at this position is outside Eq 10")
        elif lab is Layout.DP and sim is Layout.CP:
            why.append("Eq 10 gives CP's token-split prefill DP-attention's work per rank with its exchange "
                       "partly hidden under attention (the profile's eta), DP-attention's all-gather not: "
                       f"CP {self.sim_gap:.1%} ahead")
        elif lab is Layout.DP and sim is Layout.DOP:
            why.append(f"Eq 10 prices DOP {self.sim_gap:.1%} ahead of DP-attention")
        elif lab is Layout.CP:
            why.append(f"Eq 10 prices {self.simulated} {self.sim_gap:.1%} ahead of CP's token-split prefill")
        if not why:
            why.append(f"Eq 10 prices {self.simulated} {self.sim_gap:.1%} ahead of {self.label}")
        return "; ".join(why)


def fig10(sizes: AttentionSizes, theta: Theta, dest: PDDest, cfg: PDSimConfig = PDSimConfig(),
          layouts: tuple[Layout, ...] = PAPER_ORDER,
          positions: tuple[tuple[str, int, int, tuple[float, ...]], ...] = PAPER_FIG10) -> list[Position]:
    """Every sampled position of Figure 10: B prompts of the input length at t = 0 through each prefill
    layout; the batch's TTFT (its last first token, transfer included) per layout."""
    out = []
    for sweep, B, L, paper in positions:
        prompts, arrivals = np.full(B, L, dtype=np.int64), np.zeros(B)
        ttft: dict[str, float] = {}
        errors: dict[str, str] = {}
        for lay in layouts:
            r = prefill_run(sizes, theta, dest, prompts, arrivals, lay, cfg)
            ttft[lay.label] = r.makespan_s if r.ok else float("inf")
            if not r.ok:
                errors[lay.label] = r.error
        out.append(Position(sweep, B, L, ttft, {lay.label: v for lay, v in zip(PAPER_ORDER, paper)}, errors))
    return out


# ---- a mixed workload: fixed prefill layouts against auto -----------------------------------------------
@dataclass(frozen=True)
class MixedWorkload:
    prompts: np.ndarray
    arrivals: np.ndarray
    bursts: int

    @classmethod
    def make(cls, bursts: int = 24, mean_gap_s: float = 30.0, seed: int = 0,
             inputs: tuple[int, ...] = (1 * K, 4 * K, 16 * K, 32 * K, 64 * K, 128 * K),
             batches: tuple[int, ...] = (1, 4, 8, 16, 32)) -> MixedWorkload:
        """`bursts` groups arriving as a Poisson process (mean gap `mean_gap_s`), each B requests of one
        input length, B and length drawn uniformly from `batches` and `inputs` (Figure 10's axes)."""
        if bursts < 1 or mean_gap_s < 0:
            raise ConfigError("a mixed workload needs >= 1 burst and a mean gap >= 0 s")
        rng = np.random.default_rng(seed)
        starts = np.cumsum(rng.exponential(mean_gap_s, bursts))
        starts -= starts[0]  # the first burst at t = 0
        sizes_b = rng.choice(batches, bursts)
        lens = rng.choice(inputs, bursts)
        prompts = np.concatenate([np.full(b, s, dtype=np.int64) for b, s in zip(sizes_b, lens)])
        arrivals = np.concatenate([np.full(b, t) for b, t in zip(sizes_b, starts)])
        return cls(prompts, arrivals, bursts)

    @property
    def size(self) -> int:
        return len(self.prompts)


def mixed(sizes: AttentionSizes, theta: Theta, dest: PDDest, wl: MixedWorkload,
          cfg: PDSimConfig = PDSimConfig(), policy_cfg: PolicyConfig | None = None,
          layouts: tuple[Layout, ...] = PAPER_ORDER) -> dict[str, PrefillRun]:
    """The workload through every fixed prefill layout, then `auto` choosing among `layouts`."""
    out = {lay.label: prefill_run(sizes, theta, dest, wl.prompts, wl.arrivals, lay, cfg) for lay in layouts}
    pc = policy_cfg or PolicyConfig()
    out["auto"] = prefill_run(sizes, theta, dest, wl.prompts, wl.arrivals, "auto", cfg,
                              PolicyConfig(pc.margin, pc.min_dwell, layouts, cfg.page_size))
    return out


def auto_gain(runs: dict[str, PrefillRun]) -> dict[str, Any]:
    """`auto` against the best fixed layout on mean TTFT (and on the makespan)."""
    fixed = {n: r for n, r in runs.items() if n != "auto" and r.ok}
    a = runs["auto"]
    if not fixed or not a.ok:
        return {"best_fixed": None, "mean_ttft_gain": None, "makespan_gain": None}
    best = min(fixed, key=lambda n: float(fixed[n].ttft_s.mean()))
    return {"best_fixed": best, "mean_ttft_gain": float(fixed[best].ttft_s.mean() / a.ttft_s.mean()),
            "p99_ttft_gain": float(np.percentile(fixed[best].ttft_s, 99) / np.percentile(a.ttft_s, 99)),
            "makespan_gain": float(min(r.makespan_s for r in fixed.values()) / a.makespan_s)}


def plot_pd(positions: list[Position], runs: dict[str, PrefillRun] | None, path: str,
            title: str = "") -> None:
    """One panel per Figure 10 sweep (batch TTFT per prefill layout; a star on the paper's label), and the
    mixed workload's mean TTFT per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"TP": "tab:blue", "DP": "tab:orange", "CP": "tab:green", "DOP": "tab:red", "auto": "black"}
    sweeps = list(dict.fromkeys(p.sweep for p in positions))
    fig, axes = plt.subplots(1, len(sweeps) + (runs is not None), figsize=(4.2 * (len(sweeps) + 1), 4.2),
                             squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        ps = [p for p in positions if p.sweep == sweep]
        xs = list(range(len(ps)))
        for lay in ps[0].ttft_s:
            ax.plot(xs, [p.ttft_s[lay] for p in ps], marker="o", ms=3, color=colors.get(lay), label=lay)
        for x, p in zip(xs, ps):
            ax.plot([x], [p.ttft_s[p.label]], marker="*", ms=13, mfc="none", color=colors.get(p.label))
        ax.set_xticks(xs, [f"{p.input // 1024}K" if sweep.startswith("input") else str(p.batch) for p in ps])
        ax.set_yscale("log")
        ax.set_title(f"{sweep}: {sum(p.agree for p in ps)}/{len(ps)} agree")
        ax.set_ylabel("batch TTFT incl. transfer (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(title="star: paper's best")
    if runs is not None:
        bx = axes[0][-1]
        names = [n for n, r in runs.items() if r.ok]
        bx.bar(names, [float(runs[n].ttft_s.mean()) for n in names],
               color=[colors.get(n, "gray") for n in names])
        bx.set_title("mixed workload")
        bx.set_ylabel("mean TTFT (s)")
        bx.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
