"""`splash simulate rollout`: a drain workload through the cost model, per fixed layout and policy;
`splash simulate pd` (the 1P1D study) is registered from splash/commands/simulate_pd.py."""

from __future__ import annotations

import argparse
from typing import Any

from splash.commands.plan import (
    add_model_args,
    emit,
    kv_line,
    kv_summary,
    need,
    sizes_from,
    table,
    theta_from,
)
from splash.core.layouts import PAPER_PAGE_SIZE
from splash.core.model_config import ConfigError


def run_rollout(args: argparse.Namespace) -> int:
    from splash.core.layouts import parse_layouts
    from splash.core.policy import PolicyConfig
    from splash.core.simulate import SimConfig, Workload, plot_rollouts, rollout_all

    sizes = sizes_from(args)
    th = theta_from(args, sizes)
    wl = Workload.drain(args.requests, args.prompt_min, args.prompt_max, args.output_median,
                        args.output_sigma, args.output_max, seed=args.seed)
    need(args.margin, "--margin", 0)
    need(args.dwell, "--dwell", 0)
    layouts = tuple(parse_layouts(args.layouts))
    if not layouts:
        raise ConfigError("--layouts needs at least one of TP, DP, CP, DOP")
    sim = SimConfig(args.token_budget, args.max_running, args.stride, args.page_size, args.speculative_depth,
                    args.speculative_accept, "auto", args.speculative_draft_layers)
    res = rollout_all(sizes, th, wl, sim, PolicyConfig(args.margin, args.dwell, layouts, args.page_size),
                      layouts)
    finite = {n: r for n, r in res.items() if r.makespan_s != float("inf")}
    best_fixed = min((r.makespan_s for n, r in finite.items() if not n.startswith("policy")),
                     default=float("inf"))
    pol = res["policy"]
    obj: dict[str, Any] = {
        "model": sizes.cfg.name, "gpu": th.name, "ranks": th.ranks, "dtype": sizes.dtype, **kv_summary(sizes),
        "workload": {"requests": wl.size, "prompt_tokens": int(wl.prompts.sum()),
                     "output_tokens": int(wl.outputs.sum()), "longest_output": int(wl.outputs.max()),
                     "seed": args.seed},
        "runs": {n: r.to_dict() for n, r in res.items()},
        "policy_speedup_vs_best_fixed": best_fixed / pol.makespan_s if pol.makespan_s else None,
    }
    rows = []
    for n, r in res.items():
        if n not in finite:
            rows.append([n, "does not fit", "", "", "", "", ""])
            continue
        share = ", ".join(f"{k} {v / r.makespan_s:.0%}" for k, v in r.time_by_layout.items() if v > 0)
        depth = ", ".join(f"{d}: {s}" for d, s in sorted(r.steps_by_depth.items())) or "-"
        rows.append([n, f"{r.makespan_s:,.1f}", f"{r.throughput:,.0f}", f"{r.mean_completion_s:,.1f}",
                     r.switches, share, depth])
    segs = " -> ".join(f"{s['layout']}@{s['start_s']:.0f}s" for s in pol.segments())
    text = (f"drain rollout: {sizes.cfg.name} ({sizes.dtype}) on {th.name}, {wl.size} requests, "
            f"prompts {int(wl.prompts.sum()):,} tok, outputs {int(wl.outputs.sum()):,} tok "
            f"(longest {int(wl.outputs.max()):,}); {kv_line(sizes)}\n"
            + table(rows, ["run", "makespan s", "out tok/s", "mean done s", "switches", "time share",
                           "decode steps by depth"])
            + f"\npolicy timeline: {segs}\npolicy vs best fixed layout: {best_fixed / pol.makespan_s:.3f}x")
    if args.plot:
        plot_rollouts(res, args.plot, f"{sizes.cfg.name} on {th.name}: drain of {wl.size} requests")
        obj["plot"] = args.plot
        text += f"\nplot: {args.plot}"
    return emit(args, obj, text)


def register(sub: argparse._SubParsersAction) -> None:
    from splash.argtypes import output_file

    p = sub.add_parser("simulate", help="paper-scale simulations through the cost model")
    kinds = p.add_subparsers(dest="simulate_kind", metavar="KIND")
    r = kinds.add_parser("rollout", help="drain workload: fixed layouts vs the policy (table + PNG)")
    add_model_args(r, dtype_default="auto")
    r.add_argument("--gpu", default="h200", help="hardware profile: h200 | b200 | dcu | cpu (default h200)")
    r.add_argument("--theta", metavar="FILE", help="calibrated theta JSON (overrides --gpu)")
    r.add_argument("--memory-fraction", type=float, help="share of device memory to use (profile default)")
    r.add_argument("--memory-gib", type=float, help="device memory per rank (profile default)")
    r.add_argument("--requests", type=int, default=256, help="requests, all arriving at t=0 (default 256)")
    r.add_argument("--prompt-min", type=int, default=2048, help="shortest prompt (default 2048)")
    r.add_argument("--prompt-max", type=int, default=8192, help="longest prompt (default 8192)")
    r.add_argument("--output-median", type=int, default=2048, help="median output, log-normal (default 2048)")
    r.add_argument("--output-sigma", type=float, default=1.0, help="log-normal sigma (default 1.0)")
    r.add_argument("--output-max", type=int, default=16384, help="output cap (default 16384)")
    r.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    r.add_argument("--layouts", default="TP,DP,CP,DOP", help="candidate layouts (default all four)")
    r.add_argument("--margin", type=float, default=0.05, help="policy switching margin (default 0.05)")
    r.add_argument("--dwell", type=int, default=8, help="policy minimum dwell in steps (default 8)")
    r.add_argument("--token-budget", type=int, default=8192, help="rows per step (chunked prefill)")
    r.add_argument("--max-running", type=int, default=256, help="bound on the running batch")
    r.add_argument("--stride", type=int, default=16, help="decode steps simulated at once (default 16)")
    r.add_argument("--page-size", type=int, default=PAPER_PAGE_SIZE, help="KV page size (default 64)")
    r.add_argument("--speculative-depth", type=int, default=0,
                   help="drafts per verify K: also run the policy with speculation, depth chosen per step "
                        "(policy+spec) and always K (policy+spec-always); 0: none (default)")
    r.add_argument("--speculative-accept", type=float, default=0.7,
                   help="per-draft acceptance of the drafts (default 0.7)")
    r.add_argument("--speculative-draft-layers", type=int, default=1,
                   help="MTP layers a draft runs through (1, DeepSeek-V3's; 0: n-gram drafts)")
    r.add_argument("--plot", metavar="FILE", type=output_file,
                   help="write a PNG: running requests over time and makespans")
    r.set_defaults(func=run_rollout)
    from splash.commands.simulate_pd import register as register_pd

    register_pd(kinds)
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])
