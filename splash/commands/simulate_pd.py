"""`splash simulate pd`: the paper's 1P1D study (Figure 10) through the cost model, prefill layout
varied, the KV transfer priced, and `auto` on the prefill side on a mixed workload (core/simulate_pd.py)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from splash.commands.plan import emit, kv_line, kv_summary, need, sizes_from, table, theta_from
from splash.core.layouts import PAPER_PAGE_SIZE
from splash.core.model_config import ConfigError


def run_pd(args: argparse.Namespace) -> int:
    from splash.core.layouts import Layout, parse_layouts
    from splash.core.pd_cost import PDDest
    from splash.core.policy import PolicyConfig
    from splash.core.simulate_pd import MixedWorkload, PDSimConfig, auto_gain, fig10, mixed, plot_pd

    sizes = sizes_from(args)
    th = theta_from(args, sizes)
    need(args.decode_ranks, "--decode-ranks")
    need(args.token_budget, "--token-budget")
    need(args.page_size, "--page-size")
    need(args.margin, "--margin", 0)
    need(args.dwell, "--dwell", 0)
    layouts = tuple(parse_layouts(args.layouts))
    if not layouts:
        raise ConfigError("--layouts needs at least one of TP, DP, CP, DOP")
    dest = PDDest(Layout.parse(args.decode_layout), args.decode_ranks, not args.no_fill)
    sizes.cfg.check_ranks(dest.ranks)
    cfg = PDSimConfig(args.token_budget, args.page_size)
    pos = fig10(sizes, th, dest, cfg, layouts)
    agree = sum(p.agree for p in pos)
    by_sweep: dict[str, list[int]] = {}
    for p in pos:
        by_sweep.setdefault(p.sweep, [0, 0])
        by_sweep[p.sweep][0] += p.agree
        by_sweep[p.sweep][1] += 1
    obj: dict[str, Any] = {
        "model": sizes.cfg.name, "gpu": th.name, "dtype": sizes.dtype, **kv_summary(sizes),
        "prefill": {"ranks": th.ranks, "layouts": [lay.label for lay in layouts]},
        "decode": {"layout": dest.layout.label, "ranks": dest.ranks, "fill": dest.fill},
        "link": {"pd_link_bw": th.pd_bw, "pd_link_lat": th.pd_link_lat},
        "token_budget": cfg.token_budget, "page_size": cfg.page_size,
        "positions": [{"sweep": p.sweep, "batch": p.batch, "input": p.input,
                       "ttft_s": {k: _finite(v) for k, v in p.ttft_s.items()}, "simulated": p.simulated,
                       "paper": p.label, "agree": p.agree, "paper_throughput_ktok_s": p.paper,
                       "paper_lead": p.paper_lead, "label_gap": _finite(p.sim_gap), "reason": p.reason(th),
                       "errors": p.errors} for p in pos],
        "agreement": {"agree": agree, "positions": len(pos),
                      "by_sweep": {k: {"agree": a, "positions": n} for k, (a, n) in by_sweep.items()}},
    }
    rows = [[p.sweep, p.batch, f"{p.input // 1024}K", p.simulated, p.label, "yes" if p.agree else "no",
             f"{p.paper_lead:.1%}", f"{p.sim_gap:+.0%}" if p.sim_gap != float("inf") else "no fit",
             "  ".join(f"{k} {v:,.1f}" for k, v in p.ttft_s.items())] for p in pos]
    text = (f"Figure 10: {sizes.cfg.name} ({sizes.dtype}) on {th.name}, prefill T={th.ranks} -> decode "
            f"{dest.layout.label} T={dest.ranks}; {kv_line(sizes)}; link {th.pd_bw / 1e9:,.1f} GB/s per "
            f"rank + {th.pd_link_lat * 1e6:,.0f} us per transfer; token budget {cfg.token_budget}\n"
            + table(rows, ["sweep", "B", "input", "simulated", "paper", "agree", "paper lead", "label gap",
                           "batch TTFT s (last first token, transfer included)"])
            + f"\nagreement: {agree} of {len(pos)} sampled positions ("
            + ", ".join(f"{k} {a}/{n}" for k, (a, n) in by_sweep.items()) + ")")
    why: dict[str, list[str]] = {}
    for p in pos:
        if not p.agree:
            why.setdefault(p.reason(th), []).append(p.name)
    if why:
        text += "\nwhere and why it differs:" + "".join(f"\n- {', '.join(at)}: {r}" for r, at in why.items())
    runs = None
    if args.bursts:
        wl = MixedWorkload.make(args.bursts, args.mean_gap, args.seed)
        runs = mixed(sizes, th, dest, wl, cfg, PolicyConfig(args.margin, args.dwell, layouts, cfg.page_size),
                     layouts)
        gain = auto_gain(runs)
        obj["mixed"] = {"workload": {"bursts": wl.bursts, "requests": wl.size,
                                     "prompt_tokens": int(wl.prompts.sum()), "mean_gap_s": args.mean_gap,
                                     "seed": args.seed},
                        "runs": {n: r.to_dict() for n, r in runs.items()}, **gain}
        mrows = []
        for n, r in runs.items():
            d = r.to_dict()
            if not r.ok:
                mrows.append([n, "does not fit", "", "", "", ""])
                continue
            share = ", ".join(f"{k} {v / sum(r.time_by_layout.values()):.0%}"
                              for k, v in r.time_by_layout.items() if v > 0)
            mrows.append([n, f"{d['mean_ttft_s']:,.1f}", f"{d['p99_ttft_s']:,.1f}", f"{d['makespan_s']:,.1f}",
                          r.switches, share])
        text += (f"\n\nmixed workload: {wl.bursts} bursts (Poisson, mean gap {args.mean_gap:g} s, seed "
                 f"{args.seed}), {wl.size} requests, {int(wl.prompts.sum()):,} prompt tokens\n"
                 + table(mrows, ["prefill", "mean TTFT s", "P99 TTFT s", "makespan s", "switches",
                                 "time share"]))
        if gain["best_fixed"] is not None:
            text += (f"\nauto vs best fixed ({gain['best_fixed']}): mean TTFT {gain['mean_ttft_gain']:.3f}x, "
                     f"P99 {gain['p99_ttft_gain']:.3f}x, makespan {gain['makespan_gain']:.3f}x "
                     "(> 1: auto is faster)")
    if args.plot:
        plot_pd(pos, runs, args.plot, f"{sizes.cfg.name} on {th.name}: prefill layout, 1P1D")
        obj["plot"] = args.plot
        text += f"\nplot: {args.plot}"
    return emit(args, obj, text)


def _finite(v: float) -> float | None:
    """JSON has no infinity: a layout that does not fit is null (its reason under "errors")."""
    return v if math.isfinite(v) else None


def register(kinds: argparse._SubParsersAction) -> None:
    """`simulate pd`'s options (registered by splash/commands/simulate.py)."""
    from splash.argtypes import output_file
    from splash.commands.plan_args import add_model_args

    r = kinds.add_parser("pd", help="1P1D: the fastest prefill layout per Figure 10 position beside the "
                                    "paper's, and auto on a mixed workload (table + PNG)")
    add_model_args(r, dtype_default="auto", model_default="deepseek-v3.2")
    r.set_defaults(kv_dtype="fp8")
    r.add_argument("--gpu", default="h200", help="hardware profile: h200 | b200 | dcu | cpu (default h200)")
    r.add_argument("--theta", metavar="FILE",
                   help="calibrated theta JSON of the prefill group (overrides --gpu)")
    r.add_argument("--memory-fraction", type=float, help="share of device memory to use (profile default)")
    r.add_argument("--memory-gib", type=float, help="device memory per rank (profile default)")
    r.add_argument("--decode-layout", default="dp",
                   help="the decode group's layout (default dp, the paper's)")
    r.add_argument("--decode-ranks", type=int, default=8, help="ranks of the decode group (default 8)")
    r.add_argument("--no-fill", action="store_true",
                   help="a replicated decode layout receives every copy over the link")
    r.add_argument("--layouts", default="TP,CP,DP,DOP", help="prefill layouts (default all four)")
    r.add_argument("--token-budget", type=int, default=8192, help="prefill rows per step (default 8192)")
    r.add_argument("--page-size", type=int, default=PAPER_PAGE_SIZE, help="KV page size (default 64)")
    r.add_argument("--bursts", type=int, default=24, help="mixed workload: bursts of requests (0: skip it)")
    r.add_argument("--mean-gap", type=float, default=30.0, help="mixed workload: mean seconds between bursts")
    r.add_argument("--seed", type=int, default=0, help="mixed workload seed (default 0)")
    r.add_argument("--margin", type=float, default=0.05, help="auto's switching margin (default 0.05)")
    r.add_argument("--dwell", type=int, default=8, help="auto's minimum dwell in steps (default 8)")
    r.add_argument("--plot", metavar="FILE", type=output_file,
                   help="write a PNG: batch TTFT per layout along each sweep, and the mixed workload")
    r.set_defaults(func=run_pd)
