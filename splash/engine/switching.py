"""Live layout switching inside the engine: rank 0 decides and plans, every rank executes.

Rank 0 (`SwitchController`, owned by the LLMEngine): after the scheduler has planned a step in the
running layout, the controller decides whether this step switches - a forced schedule
(`--switch-schedule "STEP:LAYOUT,..."`), an explicit `request(dst)` (benchmarks), or the analytical
core's Policy (`--layout auto`) evaluated on the live batch - and if so asks the `SwitchPlanner` for
a plan over the real page allocators. A refusal is logged with its numbers and the step runs as
planned, in the current layout. A plan rewrites the step into the destination layout
(`SwitchPlan.restep`) and travels with it as `StepPlan(kind="switch", payload=plan)`; every rank runs
`run_switch_step` (the executor moves each layer's state while that step computes, see
docs/runtime.md "Switching"). After the step rank 0 commits: source pages retired, the allocators'
layout becomes the destination, each live sequence takes its new page table and owner.

Memory: with a `--memory-per-rank` budget and switching enabled, every rank's KV pool is sized as if
its attention projections were head-sharded (the largest pool the budget allows), and while the
engine runs a replicated-projection layout (DP, CP) the pages those replicas occupy are withheld
from the allocators (`weight_pages`). So each layout gets exactly the KV capacity the budget gives
it - DOP admits more than DP, TP holds 1/T of DOP's distinct tokens - and a switch into DP/CP must
find room for the replicas (the planner's Eq 5/6 check counts them as a reserve).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from splash.attention.registry import row
from splash.config import ConfigError
from splash.engine.plan import LAYOUTS, StepPlan

log = logging.getLogger("splash.switch")

MODES = ("overlapped", "blocking")
EXPOSED_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def replicas(layout: str) -> bool:
    """Whether `layout` holds every head's projections on every rank (DP, CP): replicas take pool pages."""
    return not row(layout).shards_projections


# ---- forced schedules -------------------------------------------------------------------------------
def parse_schedule(text: str | Sequence[tuple[int, str]] | None) -> list[tuple[int, str]]:
    """'8:dp,20:cp' -> [(8, 'dp'), (20, 'cp')] (sorted by step); ConfigError with the fix otherwise."""
    if text is None or text == "":
        return []
    if not isinstance(text, str):
        items = [(int(s), str(lay).lower()) for s, lay in text]
    else:
        items = []
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            step, sep, lay = part.partition(":")
            try:
                n = int(step)
            except ValueError:
                n = -1
            if not sep or n < 0:
                raise ConfigError(f"--switch-schedule: cannot read {part!r}; write STEP:LAYOUT pairs, e.g. "
                                  "'8:dp,20:cp' (STEP a non-negative engine step)")
            items.append((n, lay.lower()))
    for n, lay in items:
        if lay not in LAYOUTS:
            raise ConfigError(f"--switch-schedule: unknown layout {lay!r} at step {n}; choose one of "
                              f"{', '.join(LAYOUTS)}")
    steps = [n for n, _ in items]
    if len(set(steps)) != len(steps):
        raise ConfigError("--switch-schedule: a step appears twice; one switch per step")
    return sorted(items)


# ---- every rank: the switching step -------------------------------------------------------------------
def _timed_layout(executor: Any, dst: Any) -> Any:
    """A SwitchLayout that also adds up the time this rank spends in the executor's per-layer hook."""
    from splash.switch import SwitchLayout

    class TimedSwitchLayout(SwitchLayout):
        hook_s = 0.0

        def attention(self, layer_idx: int, mla: Any, q_in: torch.Tensor, latent_new: torch.Tensor,
                      ctx: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            self.executor.before_layer(layer_idx)
            self.hook_s += time.perf_counter() - t0
            return self.dst.attention(layer_idx, mla, q_in, latent_new, ctx)

    return TimedSwitchLayout(executor, dst)


@dataclass
class SwitchTiming:
    """One rank's view of a switching step (rank 0's goes into the engine's switch log)."""

    exposed_s: float  # time inside the executor: start() + per-layer waits/installs + finish() (CUDA: on
    # the compute stream, event-timed: its stalls on transfers plus the installs)
    total_s: float  # start() .. finish()
    wait_s: list[float]
    max_in_flight: int
    freed: list[int]


def run_switch_step(runner: Any, plan: StepPlan) -> torch.Tensor:
    """Run a "switch" plan on this rank: the step computes in the destination layout while each
    layer's state arrives; afterwards the runner's layout (and the model's form) is the destination."""
    from splash.attention.registry import make_layout
    from splash.switch import SwitchExecutor

    sw = plan.payload
    comm = getattr(runner, "switch_comm", None) or runner.comm
    ex = SwitchExecutor(sw, runner.model, runner.pool, comm)
    dst = make_layout(sw.dst)
    layout = _timed_layout(ex, dst)
    t0 = time.perf_counter()
    ex.start()
    start_s = time.perf_counter() - t0
    if plan.seqs:  # (the step message has already replaced this rank's tables by the destination's)
        ctx = runner.context(plan, layout)
        hidden = runner.model(runner.input_ids(plan), ctx.positions, ctx)
    else:
        hidden = torch.zeros(0, runner.model.cfg.hidden_size, dtype=runner.pool.dtype, device=runner.device)
    t1 = time.perf_counter()
    result = ex.finish()
    finish_s = time.perf_counter() - t1
    runner.layout = dst
    exposed = result.exposed_gpu_s if result.exposed_gpu_s is not None else start_s + layout.hook_s + finish_s
    runner.last_switch = SwitchTiming(exposed, result.total_s, list(result.wait_s),
                                      result.max_in_flight, list(result.freed))
    return hidden


# ---- rank 0: decisions, plans, commits ---------------------------------------------------------------
@dataclass
class SwitchEvent:
    """A switch that ran, or one that was refused (then `refused` holds the reason and message)."""

    step: int
    src: str
    dst: str
    cause: str  # "schedule" | "auto" | "request" | "guard" (a switch back, splash/regret.py)
    mode: str
    refused: str | None = None
    message: str = ""
    bytes_per_layer: float = 0.0  # weights + KV sent by all ranks, one layer
    layers: int = 0
    exposed_s: float = 0.0  # rank 0's time inside the executor
    total_s: float = 0.0
    plan_s: float = 0.0  # rank 0's planning time
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LayoutDecision:
    """One evaluation of the Policy on the live batch (kept for the timeline and logs)."""

    step: int
    current: str
    chosen: str
    switch: bool
    reason: str
    times_s: dict[str, float]  # predicted step time per layout (Eq 10 on the prior theta)
    feasible: list[str]
    batch: int
    rows: int
    corrected_s: dict[str, float] = field(default_factory=dict)  # times_s x the correction in force
    observed_s: dict[str, float | None] = field(default_factory=dict)  # recent measured pace on such
    #                                      steps (None: not run on such steps recently)
    correction: dict[str, dict[str, Any]] = field(default_factory=dict)  # per layout Estimate.to_dict()
    kind: str = ""  # the step kind the correction is keyed by ("decode B=3-4")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def withhold(alloc: Any, pages: Sequence[int]) -> list[list[int]]:
    """Take `pages[r]` pages out of rank r's pool (replica weights live there now); returns their ids.

    They stay marked used but leave `num_pages`, so capacity, `num_used` and the planner's
    "every used page belongs to a live request" check all see a smaller pool."""
    out = []
    for a, n in zip(alloc.ranks, pages):
        ids = a.alloc(n) if n else []
        a.num_pages -= len(ids)
        out.append(ids)
    return out


def give_back(alloc: Any, held: list[list[int]]) -> None:
    """Undo `withhold`."""
    for a, ids in zip(alloc.ranks, held):
        a.num_pages += len(ids)
        a.free(ids)


class SwitchController:
    """Rank 0's side of live switching for one engine (see the module docstring)."""

    def __init__(self, engine: Any, cfg: Any, dtype: Any, *, schedule: Sequence[tuple[int, str]] = (),
                 auto: bool = False, theta: Any = None, theta_source: str = "", margin: float = 0.05,
                 min_dwell: int = 8, mode: str = "overlapped", weight_pages: Sequence[int] | None = None,
                 budget: bool = False, history: int = 100_000) -> None:
        from splash.switch import SwitchPlanner

        if mode not in MODES:
            raise ConfigError(f"--switch-mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.engine = engine
        self.alloc = engine.allocator
        self.sched = engine.scheduler
        self.cfg = cfg
        self.world = self.alloc.world
        self.mode = mode
        self.schedule = deque(parse_schedule(schedule) if isinstance(schedule, str) else
                              parse_schedule(list(schedule)))
        self.planner = SwitchPlanner(cfg, self.alloc, dtype)
        self.weight_pages = list(weight_pages) if weight_pages is not None else [0] * self.world
        self.withheld: list[list[int]] = [[] for _ in range(self.world)]
        if replicas(self.alloc.layout) and any(self.weight_pages):
            short = [(r, a.num_pages, w) for r, (a, w) in enumerate(zip(self.alloc.ranks, self.weight_pages))
                     if w >= a.num_pages]
            if short:
                r, have, w = short[0]
                raise ConfigError(f"--memory-per-rank leaves rank {r} {have} KV pages in a sharded layout; "
                                  f"{self.alloc.layout}'s replicated attention projections take {w} of them, "
                                  f"which leaves no KV cache; raise --memory-per-rank by at least "
                                  f"{(w - have + 1) * self.planner.page_bytes / 2**20:.2f} MiB, or start in "
                                  "tp or dop")
            self.withheld = withhold(self.alloc, self.weight_pages)
        self.auto = auto
        self.policy_cfg = None
        self.theta, self.theta_source = theta, theta_source
        self.sizes = None
        if auto:
            self._init_policy(dtype, margin, min_dwell, budget)
        self.pending: Any = None  # the SwitchPlan travelling with the current step
        self._pending_event: SwitchEvent | None = None
        self._requested: tuple[str, str | None] | None = None
        self.steps_since_switch = 0
        self._last_eval: tuple[Any, int] | None = None  # (running set key, step) the Policy last priced
        self.events: deque[SwitchEvent] = deque(maxlen=history)
        self.decisions: deque[LayoutDecision] = deque(maxlen=history)
        self.switches: dict[tuple[str, str], int] = {}
        self.refusals = 0
        self.exposed: list[float] = []  # every switch's exposed seconds (histogram source)
        self.switch_backs: dict[tuple[str, str], int] = {}  # the regret guard's switches back, committed
        self._switch_back: Any = None  # a guard Verdict asking to go back at the next step
        self.feedback: Any = None  # StepFeedback (auto): the step clock behind the online correction
        if auto:
            self._init_feedback(margin)

    # ---- the policy (auto) ---------------------------------------------------------------------------
    def _init_policy(self, dtype: Any, margin: float, min_dwell: int, budget: bool) -> None:
        from splash.config import dtype_bytes
        from splash.costmodel import Theta
        from splash.policy import PolicyConfig
        from splash.sizes import AttentionSizes
        from splash.switch.planner import dtype_name

        dt = dtype_name(dtype)
        self.sizes = AttentionSizes(self.cfg, dt, dt)
        P = self.alloc.page_size
        d = self.theta.to_dict()
        # Memory feasibility is decided on the engine's real pages (`fits`); the Policy's own memory
        # model would double-count the step workspace the engine reserves apart, so it gets room to spare.
        d.update(memory_bytes=1e18, reserve_bytes=0.0, act_bytes=dtype_bytes(dt))
        self.theta = Theta.from_dict(d)
        self.policy_cfg = PolicyConfig(margin=margin, min_dwell=min_dwell, page_size=P)

    def _init_feedback(self, margin: float) -> None:
        from splash.engine.feedback import StepFeedback

        dev = getattr(getattr(self.engine.runner, "local", self.engine.runner), "device", None)
        sync = None
        if getattr(dev, "type", None) == "cuda":
            def sync() -> None:
                torch.cuda.synchronize(dev)
        self.feedback = StepFeedback(self.sizes, self.theta, self.policy_cfg.page_size, LAYOUTS, margin,
                                     self._batch, sync)

    def _batch(self, plan: StepPlan, live: list[Any]) -> Any:
        """The Policy's x: every sequence holding pages, s_i including this step's rows, q_i, owners,
        and the KV each will reach."""
        from splash.costmodel import Batch

        rows = {s.req_id: s.num_new for s in plan.seqs}
        contexts = [seq.num_computed + rows.get(seq.seq_id, 0) for seq in live]
        q = [rows.get(seq.seq_id, 0) for seq in live]
        if self.alloc.layout_row.owned:
            owners = [seq.owner for seq in live]
        else:  # owners the planner would choose: longest first onto the least-loaded rank
            owners = [0] * len(live)
            load = [0] * self.world
            for i in sorted(range(len(live)), key=lambda i: -contexts[i]):
                r = min(range(self.world), key=lambda r: (load[r], r))
                owners[i] = r
                load[r] += contexts[i]
        # Each request's KV at its own limit (prompt + max_tokens): the steady-state fit (Eq 6) of a
        # layout must hold the batch as it grows, as the planner's own Eq 6 check will demand.
        reserved = [max(c, self._projected(seq)) for c, seq in zip(contexts, live)]
        return Batch.make(contexts, q, owners, ranks=self.world, reserved=reserved)

    def capacity(self, dst: str) -> list[int]:
        """KV pages each rank can give requests in `dst` (the replicas' pages withheld in DP/CP)."""
        return [a.num_pages + len(w) - (wp if replicas(dst) else 0)
                for a, w, wp in zip(self.alloc.ranks, self.withheld, self.weight_pages)]

    def distinct_tokens(self, dst: str) -> int:
        """Distinct KV tokens the group holds in `dst` (TP replicates: one rank's share)."""
        cap = self.capacity(dst)
        return row(dst).distinct(cap) * self.alloc.page_size

    def _replica_pages(self, dst: str) -> list[int]:
        """Pages per rank a switch into `dst` must find for projection replicas (entering DP/CP)."""
        src = self.alloc.layout
        return [w if replicas(dst) and not replicas(src) else 0 for w in self.weight_pages]

    def stranded(self, dst: str, live: list[Any]) -> str | None:
        """Why `dst` could not serve some running or waiting request as far as the current layout can
        (its limit, prompt + max_tokens, or this layout's per-request reach if that is less): e.g. CP's
        position shards -> TP's one pool. None when no request loses reach. A switch must never strand
        a request: queued ones were accepted for the layout they arrived in."""
        from splash.kv.allocator import request_capacity

        seqs = [*live, *self.sched.waiting]
        if not seqs:
            return None
        need, seq = max((self._projected(s), i) for i, s in enumerate(seqs))
        P = self.alloc.page_size
        cap = request_capacity(dst, self.capacity(dst), P)
        here = request_capacity(self.alloc.layout, self.capacity(self.alloc.layout), P)
        if cap >= min(need, here):  # (a limit beyond even this layout's reach: only losing reach counts)
            return None
        what = "running" if seq < len(live) else "waiting"
        rid = getattr(getattr(seqs[seq], "group", None), "request_id", seqs[seq].seq_id)
        return (f"{what} request {rid!r} reaches {need} tokens at its limit; one request holds at most {cap} "
                f"in {dst}")

    def fits(self, dst: str, live: list[Any], rows: dict[int, int] | None = None) -> bool:
        """Whether a switch to `dst` passes the planner's memory checks on the real per-rank pools:
        Eq 6 (the live batch grown to each request's limit fits `dst`, replica pages withheld in
        DP/CP) and Eq 5 (during the switch a rank holds its current pages, the new ones and, into
        DP/CP, the replicas). Owners as the planner picks them (`balanced_owners`). `rows`: this step's
        new rows per request (their pages are new wherever a table does not cover them yet)."""
        from splash.kv.allocator import page_ranks, pages_for
        from splash.switch.planner import balanced_owners

        if self.stranded(dst, live) is not None:
            return False
        T, P, src = self.world, self.alloc.page_size, self.alloc.layout
        rows = rows or {}
        cap = self.capacity(dst)
        ends = [max(len(seq.pages[0]), pages_for(seq.num_computed + rows.get(seq.seq_id, 0), P))
                for seq in live]  # pages the destination table covers now (the planner's `n`)
        pages = [max(pages_for(self._projected(seq), P), n) for seq, n in zip(live, ends)]
        extra = self._replica_pages(dst)
        if row(dst).owned and row(src).owned:
            owners = [seq.owner for seq in live]
        elif row(dst).owned:
            held = [[sum(p >= 0 for p in row) for row in seq.pages] for seq in live]
            lacks = [[n - h for h in hs] for n, hs in zip(ends, held)]
            avail = [f - e for f, e in zip(self.alloc.num_free, extra)]
            owners, stuck, _ = balanced_owners(pages, lacks, avail, [seq.seq_id for seq in live])
            if stuck is not None:
                return False
        else:
            owners = [0] * len(live)
        need, new = [0] * T, [0] * T
        for seq, n, own, end in zip(live, pages, owners, ends):
            have = len(seq.pages[0])
            for j in range(n):
                for r in page_ranks(dst, j, own, T):
                    need[r] += 1
                    if j < end and (j >= have or seq.pages[r][j] < 0):
                        new[r] += 1
        if any(n > c for n, c in zip(need, cap)):
            return False
        used, total = self.alloc.num_used, self.alloc.num_total
        return all(u + n + e <= t for u, n, e, t in zip(used, new, extra, total))

    def _decide(self, plan: StepPlan, live: list[Any]) -> str | None:
        """Evaluate the Policy on the live batch. Memory feasibility is the engine's own page accounting
        (`fits`, exactly what the planner will check); the Policy prices each candidate (Eq 10) and
        applies its margin and dwell."""
        from splash.layouts import Layout
        from splash.policy import decide

        cur = self.alloc.layout
        if not live:
            return None
        queued = bool(self.sched.waiting)
        cands = list(LAYOUTS)
        if queued:  # requests wait for KV: never trade admission capacity for a faster step
            here = self.distinct_tokens(cur)
            cands = [lay for lay in LAYOUTS if lay == cur or self.distinct_tokens(lay) >= here]
            if cands == [cur]:
                return None  # no other layout admits as much: nothing to weigh
        # The verdict only moves when the batch does: re-evaluate when requests join or leave, the queue
        # empties or fills, a dwell ends, or every `recheck` steps as contexts grow - not every step,
        # where pricing four layouts would cost a few percent of a CPU step.
        recheck = 8  # steps
        key = (cur, queued, tuple(seq.seq_id for seq in live))
        last = self._last_eval
        if (last is not None and last[0] == key and plan.step - last[1] < recheck
                and self.steps_since_switch != self.policy_cfg.min_dwell):
            return None
        self._last_eval = (key, plan.step)
        fb = self.feedback
        batch = fb.batch(plan, live) if fb is not None else self._batch(plan, live)
        rows = {s.req_id: s.num_new for s in plan.seqs}
        kind, est = fb.estimates(plan, plan.step) if fb is not None else (None, {})
        blocked = fb.blocked(kind, plan.step) if fb is not None else []
        ok = [lay for lay in cands if lay == cur or (lay not in blocked and self.fits(lay, live, rows))]
        cfg = dataclasses.replace(self.policy_cfg, layouts=tuple(Layout.parse(lay) for lay in ok))
        corr = {Layout.parse(lay): (e.factor, e.uncertainty) for lay, e in est.items()}
        # While the regret guard judges the last switch, only a forced move may leave (dwell not reached).
        dwell = 0 if fb is not None and fb.guard.holding else self.steps_since_switch
        d = decide(self.sizes, self.theta, batch, cur, dwell, cfg, corr or None)
        here = Layout.parse(cur)
        if d.switch and est and est[cur].source != "measured" and d.evals[here].fits:
            # Measure before leaping: until the current layout has run a few steps of this kind, its
            # pace here is a guess too, and the guard would have nothing to compare the switch with.
            d = dataclasses.replace(d, layout=here, switch=False, reason=f"{d.reason}; but {cur} has not run "
                                    f"steps like this one ({kind.label}) yet: measuring it first")
            self._last_eval = None  # look again next step
        chosen = d.layout.label.lower()
        if fb is not None:
            fb.note_prices(plan, live, {lay.label.lower(): e.predicted for lay, e in d.evals.items()})
        reason = d.reason
        ruled = [lay for lay in LAYOUTS if lay not in ok and lay not in blocked]
        if ruled:
            why = "memory or the queue" if queued else "memory"
            reason += f" ({why} rules out {','.join(ruled)})"
        if blocked:
            reason += f" ({','.join(blocked)} blocked after a switch back)"
        rec = self._record(plan, live, batch, cur, chosen, d.switch, reason,
                           sorted(lay.label.lower() for lay in d.feasible), kind, est)
        if log.isEnabledFor(logging.DEBUG) or d.switch:
            msg = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in rec.corrected_s.items())
            (log.info if d.switch else log.debug)("step %d: layout %s -> %s (%s); predicted (corrected) %s; "
                                                  "B=%d rows=%d", plan.step, cur, chosen, reason, msg,
                                                  batch.size, batch.n_rows)
        return chosen if d.switch and chosen != cur else None

    def _record(self, plan: StepPlan, live: list[Any], batch: Any, cur: str, chosen: str, switch: bool,
                reason: str, feasible: list[str], kind: Any, est: dict[str, Any]) -> LayoutDecision:
        """A LayoutDecision with every layout's predicted, corrected and observed step time."""
        from splash.costmodel import step_cost
        from splash.layouts import Layout

        fb = self.feedback
        if fb is not None:
            times = {lay: fb.price(lay, plan, live) for lay in LAYOUTS}
        else:
            times = {lay: step_cost(Layout.parse(lay), self.sizes, batch, self.theta,
                                    self.policy_cfg.page_size).total for lay in LAYOUTS}
        corrected = {lay: times[lay] * (est[lay].factor if lay in est else 1.0) for lay in LAYOUTS}
        observed = ({lay: fb.correction.observed_s(lay, kind, times[lay], plan.step) for lay in LAYOUTS}
                    if fb is not None else {})
        rec = LayoutDecision(plan.step, cur, chosen, switch, reason, times, feasible, batch.size,
                             batch.n_rows, corrected, observed, {lay: e.to_dict() for lay, e in est.items()},
                             kind.label if kind is not None else "")
        self.decisions.append(rec)
        return rec

    # ---- requests from outside (benchmarks, tests) ------------------------------------------------
    def request(self, dst: str, mode: str | None = None) -> None:
        """Switch to `dst` at the next step that runs (overrides the schedule and the policy once)."""
        dst = str(dst).lower()
        if dst not in LAYOUTS:
            raise ConfigError(f"unknown layout {dst!r}; choose one of {', '.join(LAYOUTS)}")
        if mode is not None and mode not in MODES:
            raise ConfigError(f"unknown switch mode {mode!r}; choose one of {', '.join(MODES)}")
        self._requested = (dst, mode)

    # ---- the engine's hooks ---------------------------------------------------------------------------
    def before_execute(self, st: Any) -> None:
        """Decide and plan this step's switch (if any); rewrites `st.plan` into the destination."""
        plan = st.plan
        cur = self.alloc.layout
        dst, cause, mode = None, "", self.mode
        while self.schedule and self.schedule[0][0] <= plan.step:
            _, lay = self.schedule.popleft()
            dst, cause = lay, "schedule"
        if self._requested is not None:
            (dst, m), cause = self._requested, "request"
            mode = m or mode
            self._requested = None
        live = [s for s in self.sched.running if s.pages and any(p >= 0 for row in s.pages for p in row)]
        back, self._switch_back = self._switch_back, None
        if cause == "" and back is not None and back.dst == cur and live:
            dst, cause = back.src, "guard"
            self._record_back(plan, live, back)
        if self.auto and cause == "":
            dst = self._decide(plan, live)
            cause = "auto"
        try:
            self._switch_to(st, dst, cause, mode, live)
        finally:
            if self.feedback is not None:
                self.feedback.begin(st.plan, live, self.alloc.layout, switching=self.pending is not None)

    def _record_back(self, plan: StepPlan, live: list[Any], back: Any) -> None:
        """The guard's switch back, in the decision log like the Policy's verdicts."""
        fb = self.feedback
        batch = fb.batch(plan, live)
        kind, est = fb.estimates(plan, plan.step)
        rec = self._record(plan, live, batch, back.dst, back.src, True, f"switch back: {back.reason}",
                           [back.src], kind, est)
        log.info("step %d: %s; observed %s", plan.step, rec.reason,
                 " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in rec.observed_s.items() if v is not None))

    def _switch_to(self, st: Any, dst: str | None, cause: str, mode: str, live: list[Any]) -> None:
        """Plan the switch into `dst` (None: none) and rewrite `st.plan` into it, or log the refusal."""
        plan = st.plan
        cur = self.alloc.layout
        if dst is None or dst == cur:
            self.steps_since_switch += 1
            return
        t0 = time.perf_counter()
        from splash.switch import SwitchRefusal

        why = self.stranded(dst, live)
        sw = self._plan(dst, plan, live, mode) if why is None else SwitchRefusal(cur, dst, "request", why)
        plan_s = time.perf_counter() - t0

        if isinstance(sw, SwitchRefusal):
            self.refusals += 1
            self.events.append(SwitchEvent(plan.step, cur, dst, cause, mode, refused=sw.reason,
                                           message=str(sw), plan_s=plan_s))
            log.warning("step %d: %s; staying in %s", plan.step, sw, cur)
            self.steps_since_switch = 0  # do not re-plan the same refused move every step
            return
        new = sw.restep(plan)
        st.plan = dataclasses.replace(new, kind="switch", payload=sw.for_ranks(), tables=sw.tables)
        self.pending = sw
        lay = sw.layers[0] if sw.layers else None
        per_layer = (sum(lay.weight_send_bytes) + sum(lay.kv_send_bytes)) if lay else 0.0
        self._pending_event = SwitchEvent(plan.step, cur, dst, cause, sw.mode, bytes_per_layer=per_layer,
                                          layers=sw.num_layers, plan_s=plan_s)

    def _plan(self, dst: str, plan: StepPlan, live: list[Any], mode: str) -> Any:
        from splash.switch import LiveRequest

        rows = {s.req_id: s.num_new for s in plan.seqs}
        reqs = [LiveRequest(seq.seq_id, context=seq.num_computed, owner=seq.owner,
                            pages=[row[:] for row in seq.pages],
                            tokens=seq.num_computed + rows.get(seq.seq_id, 0),
                            projected=self._projected(seq))
                for seq in live]
        self.planner.reserve = self._replica_pages(dst)
        # Leaving DP/CP gives the replicas' withheld pages back at commit: dst's Eq 6 has them.
        self.planner.returned = [len(w) if not replicas(dst) else 0 for w in self.withheld]
        try:
            return self.planner.plan(dst, reqs, mode)
        finally:
            self.planner.reserve, self.planner.returned = [0] * self.world, [0] * self.world

    def _projected(self, seq: Any) -> int:
        """Expected final length: the request's own limit (prompt + max_tokens, capped by the context)."""
        p = seq.params
        ctx = self.sched.cfg.max_model_len
        limit = ctx if p.max_tokens is None else len(seq.prompt_token_ids) + p.max_tokens
        return max(seq.num_tokens, min(limit, ctx))

    def after_execute(self, st: Any) -> None:
        """The step ran on every rank: record its time (auto); commit the switch that travelled with it."""
        if self.feedback is not None:
            verdict = self.feedback.end()
            if verdict is not None:
                self._switch_back = verdict if verdict.switch_back else None
                (log.info if verdict.switch_back else log.debug)("step %d: regret guard: %s", st.plan.step,
                                                                 verdict.reason)
        sw, self.pending = self.pending, None
        if sw is None:
            return
        runner = getattr(self.engine.runner, "local", self.engine.runner)
        timing: SwitchTiming | None = getattr(runner, "last_switch", None)
        src = self.alloc.layout
        self.planner.commit(sw, freed=timing.freed if timing is not None else None)
        by_id = {seq.seq_id: seq for seq in self.sched.running}
        for rid, table in sw.tables.items():
            seq = by_id.get(rid)
            if seq is None:
                continue
            seq.pages = [row[:] for row in table]
            if seq.owner != sw.owners[rid]:
                self.sched._uncharge(seq)
                seq.owner = sw.owners[rid]
                self.sched._charge(seq)
        if replicas(sw.dst) and not replicas(src) and any(self.weight_pages):
            self.withheld = withhold(self.alloc, self.weight_pages)
        elif not replicas(sw.dst) and replicas(src) and any(len(w) for w in self.withheld):
            give_back(self.alloc, self.withheld)
            self.withheld = [[] for _ in range(self.world)]
        ev = self._pending_event
        self._pending_event = None
        if ev is not None:
            if timing is not None:
                ev.exposed_s, ev.total_s = timing.exposed_s, timing.total_s
            self.events.append(ev)
            self.exposed.append(ev.exposed_s)
        self.switches[(sw.src, sw.dst)] = self.switches.get((sw.src, sw.dst), 0) + 1
        self.steps_since_switch = 0
        cause = ev.cause if ev is not None else ""
        if cause == "guard":
            self.switch_backs[(sw.src, sw.dst)] = self.switch_backs.get((sw.src, sw.dst), 0) + 1
        if self.feedback is not None:
            self.feedback.guard.switched(st.plan.step, sw.src, sw.dst, voluntary=cause == "auto")
        log.info("step %d: switched %s -> %s (%s, %s): %.0f B/layer, exposed %.1f ms", st.plan.step, sw.src,
                 sw.dst, ev.cause if ev else "?", sw.mode, ev.bytes_per_layer if ev else 0,
                 (ev.exposed_s if ev else 0) * 1e3)

    def abort_pending(self) -> None:
        """The switching step failed before it ran everywhere: give back its destination pages."""
        sw, self.pending, self._pending_event = self.pending, None, None
        if sw is not None:
            try:
                self.planner.abort(sw)
            except RuntimeError as e:  # already committed/aborted: nothing left to undo
                log.warning("abort of switch plan %s: %s", sw.plan_id, e)

    # ---- introspection -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "layout_mode": "auto" if self.auto else "fixed",
            "switch_mode": self.mode,
            "switches_total": {f"{a}->{b}": n for (a, b), n in sorted(self.switches.items())},
            "num_switches": sum(self.switches.values()),
            "switch_refusals": self.refusals,
            "switch_exposed_seconds": list(self.exposed),
            "theta_source": self.theta_source if self.auto else None,
            "weight_pages_withheld": [len(w) for w in self.withheld],
            "num_switch_backs": sum(self.switch_backs.values()),
            "switch_backs_total": {f"{a}->{b}": n for (a, b), n in sorted(self.switch_backs.items())},
            "theta_correction": self.feedback.correction.summary() if self.feedback is not None else None,
            "regret_verdicts": ([v.to_dict() for v in self.feedback.guard.verdicts[-20:]]
                                if self.feedback is not None else []),
        }

    def close(self) -> None:
        """At shutdown: one log line saying which prior the policy ran on and how far the measured
        steps moved it."""
        if self.feedback is None:
            return
        from splash.correction import describe

        log.info("layout policy: prior %s; online correction (measured / predicted): %s; %d switch back(s)",
                 self.theta.source or self.theta_source, describe(self.feedback.correction.summary()),
                 sum(self.switch_backs.values()))


def replica_bytes(model: Any, world: int) -> int:
    """Bytes of attention projections a rank holds beyond its 1/T head slice when they are replicated
    (what a switch into DP/CP gathers, and a switch into TP/DOP drops)."""
    heads = sum(t.numel() * t.element_size() for layer in model.layers
                for t in layer.self_attn.head_tensors().values())
    held = len(model.layers[0].self_attn.heads) if model.layers else 0
    total = model.cfg.num_attention_heads
    full = heads * total // max(1, held)  # every head's blocks, whatever this rank holds now
    return int(full * (1 - 1 / world))


def weight_pages(model: Any, world: int, page_bytes: int) -> int:
    """Pages of one rank's KV pool that the replicated projections take (ceil)."""
    return -(-replica_bytes(model, world) // page_bytes) if world > 1 else 0


# ---- wiring into build_engine --------------------------------------------------------------------------
AUTO_START = "dop"  # where --layout auto starts: the most KV a budget allows, sharded projections


def resolve_layout(layout: str | None, world: int, schedule: Any) -> tuple[str, bool, list[tuple[int, str]]]:
    """(layout to load, auto?, forced schedule) from the user's options; ConfigError on bad input."""
    sched = parse_schedule(schedule)
    if layout is None:
        layout = "auto" if world > 1 else "tp"
    layout = str(layout).lower()
    if layout != "auto" and layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose auto or one of {', '.join(LAYOUTS)}")
    if world == 1:
        if sched:
            raise ConfigError("--switch-schedule needs T > 1 ranks (one rank has one layout); add --tp 2")
        return ("tp" if layout == "auto" else layout), False, []
    if layout == "auto":
        return AUTO_START, True, sched
    return layout, False, sched


def attach_switching(engine: Any, cfg: Any, model: Any, *, auto: bool, schedule: list[tuple[int, str]],
                     mode: str = "overlapped", theta: str | None = None, margin: float = 0.05,
                     min_dwell: int = 8, budget: bool = False, device: str | None = None) -> SwitchController:
    """Give a T-rank engine its SwitchController (always: benchmarks `request()` switches too)."""
    from splash.kv.pool import KVPool

    world = engine.allocator.world
    switching = auto or bool(schedule)
    wp = [0] * world
    if budget and switching:
        page_bytes = KVPool.bytes_per_page(cfg, engine.allocator.page_size, model.dtype)
        wp = [weight_pages(model, world, page_bytes)] * world
    th, src = None, ""
    if auto:
        from splash.calibration import load_or_default_theta
        from splash.switch.planner import dtype_name

        th, src = load_or_default_theta(theta, world, cfg, dtype_name(model.dtype), device)
    ctl = SwitchController(engine, cfg, model.dtype, schedule=schedule, auto=auto, theta=th, theta_source=src,
                           margin=margin, min_dwell=min_dwell, mode=mode, weight_pages=wp, budget=budget)
    engine.switcher = ctl
    return ctl
