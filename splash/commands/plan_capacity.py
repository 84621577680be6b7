"""`splash plan capacity|advise`: how much each layout holds on a memory budget (Eq 1, the cohort
simulation of appendix B.1), and which layout the policy picks for a batch (Eq 8)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from splash.commands.plan_args import (
    emit,
    kv_line,
    kv_summary,
    need,
    parse_layout_map,
    sizes_from,
    state_line,
    state_summary,
    table,
)
from splash.core.layouts import LAYOUTS, Layout, longest_balanced_context
from splash.core.model_config import ConfigError
from splash.core.sizes import GIB, AttentionSizes


def run_capacity(args: argparse.Namespace) -> int:
    from splash.core.capacity import (
        CapacityScenario,
        distinct_tokens,
        model_capacity,
        model_pools,
        pools_from_budget,
        residency_limits,
        scenario,
    )

    for value, flag in ((args.batch, "--batch"), (args.ranks, "--ranks")):
        if value is not None:
            need(value, flag)
    given = [x for x in (args.scenario, args.pool_tokens, args.memory_gib) if x is not None]
    if len(given) != 1 and not (args.model and not given):
        raise ConfigError("give exactly one of --scenario, --pool-tokens, or --memory-gib (with --model, or "
                          "--weights-gib and --kv-bytes-per-token), or --model alone (pools from --gpu)")
    sizes = None
    budget: tuple[float, int, float, bool] | None = None  # (memory, ranks, reserve, fixed) of model pools
    if args.model:  # the model's W_A and bytes per token (the core's rule), reported with every source
        if args.weights_gib is not None or args.kv_bytes_per_token is not None:
            raise ConfigError("--model gives the weights and KV bytes per token; leave out --weights-gib "
                              "and --kv-bytes-per-token")
        base_ranks = scenario(args.scenario).ranks if args.scenario else 8
        sizes = sizes_from(args, base_ranks if args.ranks is None else args.ranks)
    ranks = 8 if args.ranks is None else args.ranks
    source = (f"the {args.scenario} scenario" if args.scenario else "--pool-tokens" if args.pool_tokens
              else f"--memory-gib {args.memory_gib:g} (attention weights + KV)" if args.memory_gib is not None
              else "")
    if args.scenario:
        base = scenario(args.scenario)
    else:
        if args.pool_tokens:
            pools = {k: int(v) for k, v in parse_layout_map(args.pool_tokens, "--pool-tokens").items()}
        elif args.memory_gib is not None:
            if sizes is None and (args.weights_gib is None or args.kv_bytes_per_token is None):
                raise ConfigError("--memory-gib needs --weights-gib and --kv-bytes-per-token (or --model)")
            need(args.memory_gib, "--memory-gib", 0)
            need(args.reserve_gib, "--reserve-gib", 0)
            if sizes is not None:  # a budget for attention weights + KV, as the paper's DCU scenario
                budget = (args.memory_gib * GIB, ranks, args.reserve_gib * GIB, False)
                pools = model_pools(sizes, *budget)
            else:
                need(args.weights_gib, "--weights-gib", 0)
                need(args.kv_bytes_per_token, "--kv-bytes-per-token", 1e-9)
                pools = pools_from_budget(args.memory_gib * GIB, args.weights_gib * GIB,
                                          args.kv_bytes_per_token, ranks, args.reserve_gib * GIB)
        else:  # --model alone: the device's memory less every weight the rank holds and the reserve
            assert sizes is not None
            th = profile_theta(args.gpu, ranks, sizes, args.memory_fraction, None)
            budget = (th.memory_bytes, ranks, th.reserve_bytes, True)
            pools = model_pools(sizes, *budget)
            source = (f"{th.name}: {th.memory_bytes / GIB:,.1f} GiB per rank, {th.reserve_bytes / GIB:g} GiB "
                      "reserve")
        base = CapacityScenario("custom" if sizes is None else sizes.cfg.name,
                                16 if args.batch is None else args.batch, ranks, pools)
    batch = base.batch if args.batch is None else args.batch  # (0 is an input to refuse, not "unset")
    ranks = base.ranks if args.ranks is None else args.ranks
    slots = None
    if sizes is not None and budget is not None and sizes.z:  # a hybrid: B request states beside the KV
        pools = model_pools(sizes, *budget, requests=batch)
        base = CapacityScenario(base.name, base.batch, base.ranks, pools, base.output_min, base.output_max,
                                base.note, base.paper_limits_k)
        slots = {lay.label: c.requests for lay, c in model_capacity(sizes, budget[0], budget[1], budget[2],
                                                                    budget[3]).items()}
    sc = CapacityScenario(base.name, batch, ranks, base.pools, args.output_min, args.output_max, base.note,
                          base.paper_limits_k if (args.batch, args.ranks) == (None, None) else {})
    need(sc.batch, "--batch")
    need(sc.ranks, "--ranks")
    t = time.perf_counter()
    lim = residency_limits(sc, args.cohorts, args.seed, args.residency)
    secs = time.perf_counter() - t
    obj = {"scenario": sc.name, "batch": sc.batch, "ranks": sc.ranks, "cohorts": args.cohorts,
           "seed": args.seed,
           "residency": args.residency, "output_range": [sc.output_min, sc.output_max],
           "pool_tokens": {k.label: v for k, v in sc.pools.items()},
           "distinct_tokens_group": {k.label: distinct_tokens(k, v, sc.ranks) for k, v in sc.pools.items()},
           "limits_tokens": {k.label: v for k, v in lim.items()},
           "limits_k": {k.label: round(v / 1024, 2) for k, v in lim.items()},
           "paper_limits_k": {k.label: v for k, v in sc.paper_limits_k.items()}, "seconds": round(secs, 2)}
    model = ""
    if sizes is not None:
        obj.update(model=sizes.cfg.name, dtype=sizes.dtype, source=source, **kv_summary(sizes),
                   **state_summary(sizes), pool_gib={k.label: v * sizes.k / GIB for k, v in sc.pools.items()})
        model = (f"\n{sizes.cfg.name} ({sizes.dtype} weights): {kv_line(sizes)}{state_line(sizes)}; "
                 f"pools from {source}")
        if slots is not None:
            obj["state_slots_requests"] = slots
            model += (f"\npools after B={sc.batch} request states; state slots (requests the budget holds by "
                      "their KDA state alone): " + ", ".join(f"{k} {v:,}" for k, v in slots.items()))
    rows = []
    for lay in LAYOUTS:
        paper = sc.paper_limits_k.get(lay)
        dev = f"{(lim[lay] / 1024 - paper) / paper:+.3%}" if paper else ""
        rows.append([lay.label, f"{sc.pools[lay]:,}", f"{distinct_tokens(lay, sc.pools[lay], sc.ranks):,}",
                     f"{lim[lay] / 1024:.2f}k", f"{paper}k" if paper else "-", dev])
    text = (f"capacity '{sc.name}': B={sc.batch}, T={sc.ranks}, {args.cohorts:,} cohorts, seed {args.seed}, "
            f"{args.residency:.0%} residency ({secs:.1f} s){model}\n"
            + table(rows, ["layout", "pool tok/rank", "distinct tok/group", "limit", "paper", "diff"]))
    return emit(args, obj, text)


def _advise_depth(args: argparse.Namespace, sizes: Any, th: Any,
                  layout: Layout) -> tuple[dict[str, Any], str]:
    """The speculation depth the depth policy would run this batch at in `layout`, and each depth's price
    (splash/core/spec_depth.py; a fresh choice: no margin, no dwell)."""
    from splash.core.spec_depth import DepthConfig, depth_times, expected_tokens, prices

    need(args.speculative_depth, "--speculative-depth")
    if not 0 <= args.speculative_accept <= 1:
        raise ConfigError(f"--speculative-accept must be in [0, 1], got {args.speculative_accept}")
    cfg = DepthConfig(args.speculative_depth, draft_layers=args.speculative_draft_layers)
    times = depth_times(sizes, th, layout, [args.context] * args.batch, cfg)
    per = prices(times, [args.speculative_accept] * args.batch)
    best = min(per, key=lambda k: (per[k], k))
    a = args.speculative_accept
    rows = [[str(k) + (" *" if k == best else ""), f"{times[k] * 1e3:,.2f}",
             f"{float(expected_tokens(a, k)):.2f}", f"{per[k] * 1e3 * args.batch:,.3f}",
             f"{per[0] / per[k]:.2f}"] for k in sorted(times)]
    spec = {"depth": best, "accept": args.speculative_accept, "draft_layers": args.speculative_draft_layers,
            "step_ms": {k: times[k] * 1e3 for k in times}, "ms_per_token": {k: per[k] * 1e3 for k in per},
            "speedup": {k: per[0] / per[k] for k in per}}
    text = (f"speculation in {layout.label} at per-draft acceptance {args.speculative_accept:g} "
            f"({args.speculative_draft_layers} MTP layer(s) per draft): run depth {best}\n"
            + table(rows, ["depth", "step ms", "tokens/request", "ms per token/request", "vs depth 0"]))
    return spec, text


# ---- advise ---------------------------------------------------------------------------------------
def profile_theta(gpu: str, ranks: int, sizes: AttentionSizes, memory_fraction: float | None,
                  memory_gib: float | None):  # -> Theta
    """Theta of a hardware profile, --memory-fraction and --memory-gib checked."""
    from splash.core.hardware import theta_for

    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    if memory_gib is not None:
        need(memory_gib, "--memory-gib", 1e-9)
    return theta_for(gpu, ranks, sizes, memory_fraction, memory_gib)


def theta_from(args: argparse.Namespace, sizes: AttentionSizes):  # -> Theta
    from splash.core.theta import Theta

    if getattr(args, "theta", None):
        th = Theta.load(args.theta)
        if th.ranks != args.ranks:
            raise ConfigError(f"theta file is for T={th.ranks} but --ranks is {args.ranks}")
        return th
    return profile_theta(args.gpu, args.ranks, sizes, args.memory_fraction, args.memory_gib)


def run_advise(args: argparse.Namespace) -> int:
    from splash.core.capacity import requests_at
    from splash.core.costmodel import Batch
    from splash.core.policy import PolicyConfig, decide

    sizes = sizes_from(args)
    need(args.batch, "--batch")
    need(args.context, "--context")
    need(args.query_rows, "--query-rows")
    if args.query_rows > args.context:
        raise ConfigError(f"--query-rows ({args.query_rows}) cannot exceed --context ({args.context})")
    th = theta_from(args, sizes)
    batch = Batch.balanced(args.batch, args.context, args.query_rows, args.ranks)
    cur = None if args.current in (None, "none") else Layout.parse(args.current)
    need(args.page_size, "--page-size")
    cfg = PolicyConfig(margin=args.margin, min_dwell=0, page_size=args.page_size)
    d = decide(sizes, th, batch, cur, 1 << 30, cfg)
    avail = th.memory_bytes - sizes.fixed_bytes_per_rank(args.ranks) - th.reserve_bytes
    layouts = {}
    rows = []
    for lay in LAYOUTS:
        e = d.evals[lay]
        group = lay.distinct([e.kv_pool_tokens] * args.ranks)  # TP: one rank's pool; the others: the sum
        longest = longest_balanced_context(lay, avail, sizes.w_a, sizes.k, args.batch, args.ranks,
                                           sizes.indexer_weight_bytes(), sizes.z)
        layouts[lay.label] = {**e.to_dict(), "kv_distinct_tokens_group": group,
                              "longest_balanced_context": int(longest), **{"stages": e.cost.to_dict()}}
        rows.append([lay.label + (" *" if lay is d.layout else ""), f"{e.time * 1e3:,.2f}",
                     f"{e.memory_bytes / GIB:,.1f}", "yes" if e.fits else "NO",
                     "yes" if e.switch_fits else "NO", f"{e.kv_pool_tokens:,}", f"{group:,}",
                     f"{int(longest):,}"])
        if sizes.cfg.is_hybrid:  # requests, not tokens, can run out first: each holds its KDA state
            fit = requests_at(lay, sizes, th.memory_bytes, args.ranks, args.context, th.reserve_bytes)
            layouts[lay.label]["requests_fit_at_context"] = fit
            rows[-1].append(f"{fit:,}")
    obj = {"model": sizes.cfg.name, "gpu": getattr(th, "name", args.gpu), "theta_source": th.source,
           "ranks": args.ranks, "batch": args.batch, "context": args.context, "query_rows": args.query_rows,
           "dtype": sizes.dtype, **kv_summary(sizes), **state_summary(sizes),
           "memory_per_rank_gib": th.memory_bytes / GIB, "current": cur.label if cur else None,
           "layout": d.layout.label, "switch": d.switch,
           "reason": d.reason, "feasible": [lay.label for lay in LAYOUTS if lay in d.feasible],
           "layouts": layouts}
    dsa = (f"; DSA: main attention reads top-{sizes.cfg.index_topk} keys, the indexer scores all "
           f"{args.context:,}" if sizes.cfg.is_sparse else "")
    text = (f"{sizes.cfg.name} ({sizes.dtype} weights) on {th.name or args.gpu}, "
            f"T={args.ranks}, B={args.batch}, s={args.context}, q={args.query_rows}, "
            f"{th.memory_bytes / GIB:.1f} GiB per rank\n{kv_line(sizes)}{state_line(sizes)}{dsa}\n"
            f"-> run {d.layout.label}: {d.reason}\n"
            + table(rows, ["layout", "step ms", "mem GiB", "fits", "switch fits", "KV tok/rank",
                           "KV distinct/group", "longest s"]
                    + (["requests fit at s"] if sizes.cfg.is_hybrid else [])))
    if getattr(args, "speculative_depth", 0):
        spec, lines = _advise_depth(args, sizes, th, d.layout)
        obj["speculation"] = spec
        text += "\n" + lines
    return emit(args, obj, text)


# ---- registration ---------------------------------------------------------------------------------
