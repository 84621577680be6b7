"""`splash bench rollout`: an RL-rollout workload under each fixed layout and under `auto`.

All requests start together (a rollout batch): mixed prompt lengths (log-normal) and heavy-tailed
output lengths (Pareto), so the batch starts wide and KV-bound and narrows to a few long requests.
Output lengths are emulated the usual benchmark way: `ignore_eos` with each request's own
`max_tokens` (so the engine knows each request's limit, as it would know a user's `max_tokens`).
Every layout runs the same requests (same seed) on the same ranks and the same per-rank memory
budget; the budget is chosen so the paper's capacity regimes exist: DP/CP keep replicated attention
projections and hold the fewest KV tokens, DOP holds W_A(1-1/T)/k more per rank, TP holds as much
per rank as DOP but replicated (1/T of DOP's distinct tokens); the longest request fits every layout.
Reported per run: makespan, generated tokens/s, switches, and a per-step timeline (layout, running
and waiting requests, tokens, live KV tokens); then the phases (`splash.bench.phases`): the wide
phase while requests wait for KV, the tail after, each layout's tail step time by batch size, and
the per-phase oracle bound that says how much any switching policy could gain on this run.

The default workload is decode-heavy, as rollouts are (more generated than prompt tokens): 160
requests, prompts of median 48 tokens, outputs Pareto from 16 tokens with tail index 1 up to 512 (median
~34), and a budget whose DP pool holds two of the longest request per rank (DOP then holds 1.6x DP's
distinct tokens, TP 0.8x). On a 2-core CPU at T=2 (measured, docs/analytics.md) a decode step is mostly
fixed overhead (~12 ms at B=1, well under 1 ms more per request), so holding more requests speeds the
wide phase and DOP, with the most distinct KV, finishes it in about half TP's time; in the narrow tail
DOP's all-to-alls make each step ~40% slower than TP's. Only a layout change can win both phases.
`--quick` is a small, prefill-heavy batch for tests and smoke runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.bench.report import report
from splash.bench.rollout_report import plot, table
from splash.core.layouts import DEFAULT_PAGE_SIZE, Layout
from splash.step.plan import LAYOUTS

RUNS = (*LAYOUTS, "auto")


@dataclass(frozen=True)
class Workload:
    requests: int = 160
    prompt_median: int = 48
    prompt_max: int = 192
    output_scale: float = 16.0  # Pareto x_m: most outputs are short
    output_alpha: float = 1.0  # tail index: heavy
    output_max: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        from splash.core.model_config import ConfigError

        if not (self.output_scale > 0 and self.output_alpha > 0):
            raise ConfigError(f"--output-scale and --output-alpha must be > 0, got {self.output_scale:g} "
                              f"and {self.output_alpha:g}")
        if self.prompt_max < 4 or self.output_max < 2:
            raise ConfigError(f"prompts need --prompt-max >= 4 and outputs --output-max >= 2, got "
                              f"{self.prompt_max} and {self.output_max}")

    def sample(self, vocab: int) -> tuple[list[list[int]], list[int]]:
        rng = np.random.default_rng(self.seed)
        plens = np.clip(rng.lognormal(np.log(self.prompt_median), 0.6, self.requests), 4, self.prompt_max)
        tail = self.output_scale * (1 + rng.pareto(self.output_alpha, self.requests))
        olens = np.clip(tail, 2, self.output_max)
        prompts = [rng.integers(3, vocab, int(n)).tolist() for n in plens]
        return prompts, [int(n) for n in olens]

    @property
    def longest(self) -> int:
        return self.prompt_max + self.output_max


KV_LONGEST = 2  # default budget: DP's KV per rank holds this many of the longest request

QUICK = Workload(requests=48, prompt_median=32, prompt_max=96, output_scale=2.0, output_max=128)
SHAPE_FLAGS = (("requests", int, "requests started together"),
               ("prompt_median", int, "median prompt length, log-normal"),
               ("prompt_max", int, "cap on prompt length"),
               ("output_scale", float, "Pareto x_m of the output lengths: the typical short output"),
               ("output_alpha", float, "Pareto tail index of the output lengths; smaller is heavier"),
               ("output_max", int, "cap on generated tokens per request: the tail"))


def register(kinds: argparse._SubParsersAction) -> None:
    from splash.argtypes import output_file, positive_int

    p = kinds.add_parser("rollout", help="RL-rollout workload: each fixed layout vs live switching (auto)",
                         description="Run one rollout batch under tp, dp, cp, dop and auto on the same "
                                     "ranks, requests and memory budget; compare makespan and throughput.")
    p.add_argument("--tp", type=positive_int, default=2, help="ranks T (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and lengths")
    p.add_argument("--quick", action="store_true", help="a smaller workload (about a minute at T=2)")
    for field, kind, what in SHAPE_FLAGS:  # the workload's shape; unset: the default or quick workload's
        p.add_argument("--" + field.replace("_", "-"), type=positive_int if kind is int else float,
                       default=None,
                       help=f"{what} (default {getattr(Workload, field):g}, quick {getattr(QUICK, field):g})")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs per layout, interleaved in rotating order (reversed every other repeat); the "
                        "median run counts (default 1)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)} to run")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep every run in the JSON (`every_run`, in the order they ran, with each repeat's "
                        "timeline), not only each layout's median run: for step-by-step comparisons of the "
                        "runs of one repeat")
    p.add_argument("--kv-tokens", type=positive_int, default=None,
                   help="KV tokens per rank under DP (sets the memory budget; default: twice the longest "
                        "request)")
    p.add_argument("--theta", default=None, metavar="FILE|PROFILE",
                   help="auto's prior: a calibrated theta file or a hardware profile (cpu, h200, b200, dcu)")
    p.add_argument("--switch-margin", type=float, default=0.05)
    p.add_argument("--min-dwell-steps", type=int, default=8)
    p.add_argument("--switch-mode", default="overlapped", choices=("overlapped", "blocking"))
    p.add_argument("--speculative-algorithm", default=None, type=str.upper,
                   choices=("NGRAM", "MTP", "EAGLE"),
                   help="also run each of --runs with speculative decoding: with the depth policy "
                        "(NAME+spec) and always at full depth (NAME+spec-always); reported by phase beside "
                        "the run without")
    p.add_argument("--speculative-num-steps", type=positive_int, default=3,
                   help="drafts per step (default 3)")
    p.add_argument("--speculative-modes", default="off,auto,always",
                   help="which of off (no speculation), auto (the depth policy), always to run")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="FILE", type=output_file, help="write the timeline PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def budget_bytes(group: Any, args: argparse.Namespace, kv_tokens: int) -> int:
    """Per-rank memory: DP's (replicated) weights + step workspace + `kv_tokens` of KV."""
    from splash.engine.build import build_engine
    from splash.kv.pool import KVPool

    probe = build_engine(args.model, dtype=args.dtype, tp=args.tp, layout="dp", rank_group=group,
                         num_kv_pages=4, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                         device=args.device)
    try:
        st = probe.stats()
        cfg = probe.runner.local.model.cfg
        import torch

        per_page = KVPool.bytes_per_page(cfg, args.page_size, getattr(torch, args.dtype))
    finally:
        probe.shutdown()
    pages = -(-kv_tokens // args.page_size)
    return int(max(st["weight_bytes_per_rank"]) + st["kv_reserve_bytes"] + pages * per_page + per_page // 2)


def snapshot(eng: Any) -> dict[str, Any]:
    """The few `stats()` fields the timeline needs, read directly: the full stats (with auto's
    correction summary) every step would time the bench's own bookkeeping into auto's makespan."""
    a, sched, sw = eng.allocator, eng.scheduler, eng.switcher
    return {"layout": a.layout, "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "num_requests": len(eng.requests), "generation_tokens_total": eng.generation_tokens_total,
            "kv_pages_used_per_rank": a.num_used, "page_size": a.page_size,
            "num_switch_backs": sum(sw.switch_backs.values()) if sw is not None else 0}


def distinct_held(st: dict[str, Any]) -> int:
    """Distinct KV tokens the live requests hold now (the core's rule: replicated pages count once)."""
    return Layout.parse(st["layout"]).distinct(st["kv_pages_used_per_rank"]) * st["page_size"]


def final_tokens(eng: Any) -> int:
    """Distinct KV tokens the running requests will hold at their limits (prompt + max_tokens): what a
    layout must hold to take the batch over without preempting anyone later."""
    sched = eng.scheduler
    return sum(sched.projected_pages(s) for s in sched.running) * sched.alloc.page_size


SPEC_SUFFIX = {"off": "", "auto": "+spec", "always": "+spec-always"}


def run_one(group: Any, args: argparse.Namespace, layout: str, memory: int, prompts: list[list[int]],
            outs: list[int], bar: Any = None, spec: str = "off") -> dict[str, Any]:
    from splash.engine.build import build_engine
    from splash.engine.sampling import SamplingParams
    from splash.worker.host_malloc import freeze_heap, thaw_heap

    eng = build_engine(args.model, dtype=args.dtype, tp=args.tp, layout=layout, rank_group=group,
                       memory_per_rank=memory, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                       device=args.device, theta=args.theta, switch_margin=args.switch_margin,
                       min_dwell_steps=args.min_dwell_steps, switch_mode=args.switch_mode,
                       **spec_options(args, spec))
    timeline: list[dict[str, Any]] = []
    # What start-up built lives through the run, as in `splash serve`: frozen, so a full collection
    # over it (stalling both ranks) cannot land in one layout's run and not another's.
    freeze_heap()
    try:
        st0 = eng.stats()
        for i, (p, n) in enumerate(zip(prompts, outs)):
            eng.add_request(str(i), prompt_token_ids=p,
                            params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        t0 = time.perf_counter()
        gen0 = backs0 = 0
        while eng.has_unfinished():
            layout_before = eng.allocator.layout
            eng.step(final_only=True)
            st = snapshot(eng)
            now = time.perf_counter() - t0
            timeline.append({"t": now, "layout": st["layout"], "from": layout_before,
                             "running": st["num_running"], "waiting": st["num_waiting"],
                             "tokens": st["generation_tokens_total"] - gen0,
                             "kv_tokens": distinct_held(st), "kv_final_tokens": final_tokens(eng),
                             "switch_back": st.get("num_switch_backs", 0) > backs0,
                             "depth": depth(eng)})
            gen0, backs0 = st["generation_tokens_total"], st.get("num_switch_backs", 0)
            if bar is not None:
                bar.set_postfix_str(f"{layout}: {len(prompts) - st['num_requests']}/{len(prompts)} done, "
                                    f"{st['layout']}", refresh=False)
                bar.update(0)
        makespan = time.perf_counter() - t0
        st = eng.stats()
        events = [e.to_dict() for e in eng.switcher.events] if eng.switcher is not None else []
        decisions = list(eng.switcher.decisions) if eng.switcher is not None else []
    finally:
        eng.shutdown()
        thaw_heap()
    gen = st["generation_tokens_total"]
    return {"throughput_tok_s": gen / makespan, "makespan_s": makespan,
            "switches": st.get("num_switches", 0), "switch_backs": st.get("num_switch_backs", 0),
            "total_tok_s": (gen + st["prompt_tokens_total"]) / makespan,
            "generated_tokens": gen, "steps": st["steps"], "preemptions": st["num_preemptions"],
            "refusals": st.get("switch_refusals", 0),
            "kv_pool_tokens_per_rank": st0["kv_pool_tokens_per_rank"],
            "kv_distinct_tokens": st0["kv_distinct_tokens"],
            "max_running": max((x["running"] for x in timeline), default=0),
            "switch_events": events, "decisions": len(decisions), "decision_log": changes(decisions),
            "timeline": timeline,
            "switches_total": st.get("switches_total", {}),
            "theta_source": st.get("theta_source"), "theta_correction": st.get("theta_correction"),
            "regret_verdicts": st.get("regret_verdicts", []),
            "speculation": {k: st.get(k) for k in SPEC_STATS}}


SPEC_STATS = ("speculative_algorithm", "speculative_policy", "spec_verify_ct", "spec_draft_tokens",
              "spec_accepted_tokens", "spec_accept_length", "spec_depth_changes")


def spec_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """build_engine's speculative options of a run: none, the depth policy, or always full depth."""
    if mode == "off" or not getattr(args, "speculative_algorithm", None):
        return {}
    return {"speculative_algorithm": args.speculative_algorithm,
            "speculative_num_steps": args.speculative_num_steps, "speculative_policy": mode}


def depth(eng: Any) -> int:
    """The speculation depth the engine's next step runs at (0: off)."""
    if eng.scheduler.proposer is None:
        return 0
    return eng.depth.k if eng.depth is not None else eng.config.num_drafts


def changes(decisions: list[Any]) -> list[dict[str, Any]]:
    """The policy evaluations where its verdict moved (a switch or a switch back, or another best or
    feasible set): the evidence for each switch auto made, or did not make, with every layout's
    predicted (prior), corrected and observed step time and the correction in force."""
    def ms(d: dict[str, float | None]) -> dict[str, float | None]:
        return {k: None if v is None else round(v * 1e3, 2) for k, v in d.items()}

    out: list[dict[str, Any]] = []
    prev = None
    for d in decisions:
        times = d.corrected_s or d.times_s
        best = min(d.feasible, key=lambda lay: times[lay]) if d.feasible else None
        now = (d.current, best, tuple(d.feasible))
        if d.switch or now != prev:
            out.append({"step": d.step, "current": d.current, "chosen": d.chosen, "switch": d.switch,
                        "batch": d.batch, "kind": d.kind, "feasible": d.feasible, "reason": d.reason,
                        "predicted_ms": ms(d.times_s), "corrected_ms": ms(d.corrected_s),
                        "observed_ms": ms(d.observed_s), "correction": d.correction})
        prev = now
    return out


def per_repeat(every: dict[str, list[dict[str, Any]]], repeats: int,
               pooled: dict[str, dict[int, float]]) -> dict[str, Any]:
    """auto against the best fixed layout and against the gated per-phase oracle, repeat by repeat
    (the runs of one repeat ran back to back, so the machine's state cancels best there); `pooled`:
    `phases.pooled_times(every)`, what each repeat's oracle chooses by."""
    from splash.bench.phases import analyse

    if "auto" not in every or len(every) < 2:
        return {}
    vs_best, vs_oracle, vs_min, best_each, oracle_s = [], [], [], [], []
    for i in range(repeats):
        runs = {lay: every[lay][i] for lay in every}
        fixed = {k: v for k, v in runs.items() if k != "auto"}
        best = max(fixed, key=lambda k: fixed[k]["throughput_tok_s"])
        best_each.append(best)
        vs_best.append(runs["auto"]["throughput_tok_s"] / fixed[best]["throughput_tok_s"])
        gated, own = analyse(runs, pooled)["oracle_gated"], analyse(runs)["oracle_gated"]
        if gated:
            vs_oracle.append(gated["makespan_s"] / runs["auto"]["makespan_s"])
            vs_min.append(own["makespan_s"] / runs["auto"]["makespan_s"])
            oracle_s.append(gated["makespan_s"])
    # Over all repeats together: makespans add up, so the ratio of total times is what running the
    # repeats' batches one after another would show. A ratio per repeat divides one noisy run by
    # another (a layout's run varies by ~10% here, and its slow runs are rarer and longer than its fast
    # ones), so their median can sit apart from the ratio of the totals by a few points.
    auto_s = sum(r["makespan_s"] for r in every["auto"])
    fixed_s = {k: sum(r["makespan_s"] for r in v) for k, v in every.items() if k != "auto"}
    return {"auto_vs_best_fixed": float(np.median(vs_best)), "auto_vs_best_fixed_each": vs_best,
            "best_fixed_each": best_each,
            "auto_vs_best_fixed_of_totals": min(fixed_s.values()) / auto_s,
            "auto_vs_oracle_gated": float(np.median(vs_oracle)) if vs_oracle else None,
            "auto_vs_oracle_gated_each": vs_oracle,
            "auto_vs_oracle_gated_of_totals": (sum(oracle_s) / auto_s if len(oracle_s) == repeats
                                               else None),
            # the oracle choosing by this repeat's own means alone (biased to a layout's lucky run)
            "auto_vs_oracle_gated_own_choice": float(np.median(vs_min)) if vs_min else None,
            "auto_vs_oracle_gated_own_choice_each": vs_min}


def run_order(runs: list[str], rep: int) -> list[str]:
    """Repeat `rep`'s order: rotated, so no layout always runs first or last, and reversed every other
    repeat, so no layout always runs right after the same one (auto would otherwise always follow DOP,
    in whatever state DOP's run left the machine and the rank processes). The rotation moves every
    other repeat: rotating each repeat by one undoes the reversal of two runs (`--runs dop,auto` ran
    DOP first in every repeat)."""
    order = runs if rep % 2 == 0 else runs[::-1]
    k = (rep // 2) % len(order)
    return order[k:] + order[:k]


def rollout(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from splash.core.model_config import ConfigError
    from splash.engine.group import RankGroup

    runs = [r.strip().lower() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad or not runs:
        raise ConfigError(f"--runs: unknown {bad}; choose from {','.join(RUNS)}")
    modes = ["off"]
    if getattr(args, "speculative_algorithm", None):
        modes = [m.strip().lower() for m in args.speculative_modes.split(",") if m.strip()]
        if not modes or any(m not in SPEC_SUFFIX for m in modes):
            raise ConfigError(f"--speculative-modes: choose from {','.join(SPEC_SUFFIX)}, got "
                              f"{args.speculative_modes!r}")
    named = {r + SPEC_SUFFIX[m]: (r, m) for r in runs for m in modes}  # run name -> (layout, mode)
    wl = QUICK if args.quick else Workload()
    given = {k: getattr(args, k, None) for k, _, _ in SHAPE_FLAGS}
    wl = Workload(**{**wl.__dict__, **{k: v for k, v in given.items() if v is not None}, "seed": args.seed})
    kv_tokens = args.kv_tokens or KV_LONGEST * wl.longest
    if kv_tokens < wl.longest:
        raise ConfigError(f"--kv-tokens {kv_tokens} cannot hold the longest request ({wl.longest} tokens) "
                          "under DP; raise it")
    args.max_model_len = wl.longest + args.page_size
    args.max_num_seqs = wl.requests
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    group = RankGroup.start(args.tp, device=args.device, threads=1)
    bar = None
    try:
        memory = budget_bytes(group, args, kv_tokens)
        from splash.core.model_config import ModelConfig
        from splash.model import resolve_model_path

        vocab = ModelConfig.from_hf(resolve_model_path(args.model)).vocab_size
        prompts, outs = wl.sample(vocab)
        if not args.quiet:
            from splash.progress import progress_bar

            bar = progress_bar(len(named) * args.repeats, "bench rollout", "run")
        every: dict[str, list[dict[str, Any]]] = {name: [] for name in named}
        ran: list[dict[str, Any]] = []  # (--keep-runs) every run, in the order they ran
        for rep in range(args.repeats):
            for pos, name in enumerate(run_order(list(named), rep)):
                lay, mode = named[name]
                every[name].append(run_one(group, args, lay, memory, prompts, outs, bar, mode))
                ran.append({"repeat": rep, "position": pos, "layout": lay, "run": name, **every[name][-1]})
                if bar is not None:
                    bar.update(1)
        results = {}
        for lay in named:
            ranked = sorted(every[lay], key=lambda r: r["throughput_tok_s"])
            results[lay] = dict(ranked[len(ranked) // 2],
                                throughput_all_tok_s=[r["throughput_tok_s"] for r in every[lay]])
    finally:
        if bar is not None:
            bar.close()
        group.close()
    from splash.bench.phases import analyse, pooled_times, split

    spec_runs = {name: results.pop(name) for name in list(results) if named[name][1] != "off"}
    for name in spec_runs:
        every.pop(name)
    pooled = pooled_times(every)
    fixed = {k: v for k, v in results.items() if k != "auto"}
    best = max(fixed, key=lambda k: fixed[k]["throughput_tok_s"]) if fixed else None
    of_medians = (results["auto"]["throughput_tok_s"] / fixed[best]["throughput_tok_s"]
                  if "auto" in results and best else None)
    doc = {"runs": results, "best_fixed": best,
           # the median over repeats of auto / best fixed within each repeat (and each repeat's below)
           "auto_vs_best_fixed": of_medians, "auto_vs_best_fixed_of_median_runs": of_medians,
           **per_repeat(every, args.repeats, pooled),
           "phases": analyse(results, pooled),
           "workload": {**wl.__dict__, "prompt_tokens": int(sum(map(len, prompts))),
                        "output_tokens": int(sum(outs)),
                        "longest_output": int(max(outs)), "median_output": float(np.median(outs))},
           "config": {"tp": args.tp, "model": args.model, "dtype": args.dtype, "page_size": args.page_size,
                      "memory_per_rank": memory, "kv_tokens_dp": kv_tokens, "theta": args.theta,
                      "switch_margin": args.switch_margin, "min_dwell_steps": args.min_dwell_steps,
                      "switch_mode": args.switch_mode, "repeats": args.repeats,
                      "seconds": time.perf_counter() - t_start}}
    if spec_runs:  # speculation by phase: each run beside the same layout's run without it
        doc["speculation"] = {name: {**spec_phases(r, split(r["timeline"])), "layout": named[name][0],
                                     "mode": named[name][1]}
                              for name, r in {**{n: results[n] for n in results}, **spec_runs}.items()}
        doc["speculation_runs"] = spec_runs
    if args.keep_runs:
        doc["every_run"] = ran
    return doc


def spec_phases(r: dict[str, Any], ph: dict[str, Any]) -> dict[str, Any]:
    """One run's makespan, throughput and wide/tail phases (tokens/s in each) and its depth by phase."""
    tl = r["timeline"]
    n = ph["wide_steps"]
    depths = [x.get("depth", 0) for x in tl]
    return {"makespan_s": r["makespan_s"], "throughput_tok_s": r["throughput_tok_s"], "steps": r["steps"],
            "wide_s": ph["wide_s"], "tail_s": ph["tail_s"],
            "wide_tok_s": ph.get("wide_tokens", 0) / ph["wide_s"] if ph["wide_s"] else None,
            "tail_tok_s": ph.get("tail_tokens", 0) / ph["tail_s"] if ph["tail_s"] else None,
            "wide_mean_depth": float(np.mean(depths[:n])) if n else None,
            "tail_mean_depth": float(np.mean(depths[n:])) if len(depths) > n else None,
            **{k: v for k, v in r.get("speculation", {}).items() if v is not None}}


def run(args: argparse.Namespace) -> int:
    if args.tp < 2:
        print("splash bench rollout: error: comparing layouts needs --tp 2 or more", file=sys.stderr)
        return 2
    return report("rollout", args, rollout, table, plot)
