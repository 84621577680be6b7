"""`splash plan weights|switches|crossovers|capacity|advise|pd`: the analytical core on the command line
(capacity and advise in plan_capacity.py, the shared options in plan_args.py).

Every subcommand prints a readable table, or exactly one JSON object with --json. Bad input
raises ConfigError, which `splash.cli` turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from splash.commands.plan_args import (
    KV_DTYPE_HELP,
    MAX_PAGES,
    MAX_SCAN_K,
    add_model_args,
    emit,
    kv_line,
    kv_summary,
    need,
    sizes_from,
    state_line,
    state_summary,
    table,
)
from splash.commands.plan_capacity import run_advise, run_capacity, theta_from
from splash.core.layouts import DIRECTIONS, PAPER_PAGE_SIZE, Layout
from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.core.sizes import GIB, MIB


def run_weights(args: argparse.Namespace) -> int:
    from splash.core.manifest import weights_report

    rep = weights_report(sizes_from(args), args.ranks)
    pl = rep["per_layer_mib"]
    rows = [[k, f"{v:,.2f}"] for k, v in pl.items()]
    text = (f"{rep['model']} ({rep['dtype']}{', with FP8 scales' if rep['fp8_scales'] else ''}), "
            f"T={rep['ranks']}, {rep['layers']} layers\n"
            + table(rows, ["projection", "MiB/layer"])
            + "\nsharded -> replicated switch receives "
            f"{rep['receive_mib_per_rank']:,.2f} MiB per rank per layer"
            f" ({rep['receive_mib_group']:,.2f} MiB across the group; "
            f"{rep['receive_mib_per_rank_all_layers'] / 1024:,.2f} GiB per rank over all layers)")
    return emit(args, rep, text)


# ---- switches -------------------------------------------------------------------------------------
def run_switches(args: argparse.Namespace) -> int:
    from splash.core.manifest import switch_manifest

    sizes = sizes_from(args)
    need(args.batch, "--batch", 0)
    need(args.context, "--context", 0)
    need(args.page_size, "--page-size")
    pages = args.batch * -(-args.context // args.page_size)
    if pages > MAX_PAGES:  # the manifest holds a row per page: past this it is memory, not an answer
        raise ConfigError(f"--batch x --context = {pages:,} pages of {args.page_size}, more than the "
                          f"{MAX_PAGES:,} a manifest is built for; raise --page-size or shrink them")
    batch = [args.context] * args.batch
    hybrid = sizes.cfg.is_hybrid
    out, rows = [], []

    def entry(st: Any) -> dict[str, Any]:
        return {"primitive": st.primitive, "bytes_per_rank": st.bytes_per_rank, "bytes_group": st.total_bytes}

    for a, b in DIRECTIONS:
        m = switch_manifest(sizes, a, b, batch, args.ranks, args.page_size)
        w, kv = m.weights, m.kv
        item = {"from": a.label, "to": b.label, "weights": entry(w), "kv": entry(kv),
                "bytes_per_rank_all_layers": float(m.recv_bytes_per_rank().max(initial=0))}
        total = m.recv_bytes_per_rank().max(initial=0)
        row = [f"{a.label}->{b.label}", w.primitive, f"{w.bytes_per_rank / MIB:,.2f}", kv.primitive,
               f"{kv.bytes_per_rank / MIB:,.2f}"]
        if hybrid:  # a KDA layer moves its projections and its per-request states (no KV)
            kw, st = m.kda_weights, m.state
            item.update(kda_weights=entry(kw), state=entry(st))
            row += [kw.primitive, f"{kw.bytes_per_rank / MIB:,.2f}", st.primitive,
                    f"{st.bytes_per_rank / MIB:,.2f}"]
        out.append(item)
        rows.append(row + [f"{total / GIB:,.2f}"])
    obj = {"model": sizes.cfg.name, "ranks": args.ranks, "batch": args.batch, "context": args.context,
           "dtype": sizes.dtype, "kv_dtype": sizes.kv_dtype, "page_size": args.page_size,
           "layers": sizes.layers, **kv_summary(sizes), **state_summary(sizes),
           "note": "per layer (the largest layer's KV): bytes_per_rank busiest rank, bytes_group all ranks"
                   + ("; kda_weights and state: one KDA layer's" if hybrid else ""),
           "switches": out}
    header = ["switch", "MLA weights", "MiB", "KV", "MiB"]
    if hybrid:
        header += ["KDA weights", "MiB", "KDA state", "MiB"]
    text = (f"{sizes.cfg.name}: T={args.ranks}, B={args.batch}, s={args.context}, weights {sizes.dtype}; "
            f"{kv_line(sizes)}{state_line(sizes)}; per layer of each kind, busiest rank\n"
            + table(rows, header + ["GiB all layers"]))
    return emit(args, obj, text)


# ---- crossovers -----------------------------------------------------------------------------------
def _law_limits(args: argparse.Namespace) -> dict[Layout, float] | None:
    from splash.core.capacity import residency_limits, scenario
    from splash.core.law import B200_DISPLAYED_LIMITS_K

    if args.limits == "none":
        return None
    sc = args.scenario.lower()
    if sc == "b200":  # the paper's B200 figure: TP sampled, the others prescribed
        if args.limits == "sampled":
            tp = residency_limits(scenario("b200"))[Layout.TP]
            return {**{k: v * 1024 for k, v in B200_DISPLAYED_LIMITS_K.items()}, Layout.TP: float(tp)}
        return {k: v * 1024 for k, v in B200_DISPLAYED_LIMITS_K.items()}
    if args.limits == "paper":
        return {k: v * 1024 for k, v in scenario(sc).paper_limits_k.items()}
    return {k: float(v) for k, v in residency_limits(scenario(sc)).items()}


def run_crossovers(args: argparse.Namespace) -> int:
    from splash.core.law import alpha, crossovers, plot_law

    need(args.lo_k, "--lo-k", 1e-6)
    if args.hi_k <= args.lo_k:
        raise ConfigError(f"--hi-k ({args.hi_k}) must exceed --lo-k ({args.lo_k})")
    if not args.hi_k <= MAX_SCAN_K:  # (also NaN, inf) the scan steps by 8 tokens
        raise ConfigError(f"--hi-k must be at most {MAX_SCAN_K:g} (16M tokens), got {args.hi_k:g}")
    if args.model is not None:
        return _model_crossovers(args)
    a = alpha(args.scenario)
    limits = _law_limits(args)
    cs = crossovers(args.scenario, args.lo_k * 1024, args.hi_k * 1024, limits=limits)
    obj: dict[str, Any] = {"scenario": args.scenario.lower(), "alpha": a,
                           "range_k": [args.lo_k, args.hi_k], "crossovers": [c.to_dict() for c in cs],
                           "limits_k": None if limits is None else
                           {k.label: round(v / 1024, 2) for k, v in limits.items()}}
    if args.plot:
        plot_law(args.scenario.lower(), args.plot, limits, hi=args.hi_k * 1024)
        obj["plot"] = args.plot
    rows = [[f"{c.at_k:.1f}k", c.src.label, c.dst.label, c.cause] for c in cs]
    text = (f"fastest layout of the illustrative law (Eq 11/12), scenario {args.scenario} (alpha={a})\n"
            + table(rows, ["at", "from", "to", "cause"]) + (f"\nplot: {args.plot}" if args.plot else ""))
    return emit(args, obj, text)


def _model_crossovers(args: argparse.Namespace) -> int:
    """`plan crossovers --model M`: the cost model's (Eq 10) crossovers for that model on a GPU profile."""
    from splash.core.policy import crossovers

    if args.limits != "none" or args.plot:
        raise ConfigError("--limits and --plot belong to the illustrative law; with --model the cost model "
                          "checks each layout's memory itself (--ignore-memory to leave it out)")
    sizes = sizes_from(args)
    need(args.batch, "--batch")
    need(args.query_rows, "--query-rows")
    need(args.page_size, "--page-size")
    lo, hi = max(1, round(args.lo_k * 1024)), round(args.hi_k * 1024)
    if args.query_rows > lo:
        raise ConfigError(f"--query-rows ({args.query_rows}) cannot exceed the shortest context ({lo})")
    th = theta_from(args, sizes)
    cs, end = crossovers(sizes, th, args.batch, args.query_rows, lo, hi, page_size=args.page_size,
                         check_memory=not args.ignore_memory)
    obj: dict[str, Any] = {"model": sizes.cfg.name, "gpu": th.name, "theta_source": th.source,
                           "ranks": args.ranks, "batch": args.batch, "query_rows": args.query_rows,
                           "dtype": sizes.dtype, **kv_summary(sizes), "sparse": sizes.cfg.is_sparse,
                           "index_topk": sizes.cfg.index_topk, "memory_checked": not args.ignore_memory,
                           "range_k": [args.lo_k, args.hi_k], "crossovers": [c.to_dict() for c in cs],
                           "nothing_fits_from_tokens": end}
    rows = [[f"{c.at_k:.1f}k", c.src.label, c.dst.label, c.cause] for c in cs]
    dsa = f", DSA top-{sizes.cfg.index_topk}" if sizes.cfg.is_sparse else ""
    tail = ""
    if end == lo:
        weights = min(sizes.fixed_bytes_per_rank(args.ranks) + sizes.attention_weight_bytes(sh, args.ranks)
                      for sh in (True, False))
        tail = (f"\nno layout fits B={args.batch} even at s={lo:,}: the weights alone take "
                f"{weights / GIB:,.1f} GiB per rank of {th.memory_bytes / GIB:,.1f}; try --dtype fp8, more "
                "--ranks or a larger --gpu")
    elif end is not None:
        tail = f"\nno layout fits B={args.batch} from s={end:,} ({end / 1024:.1f}k)"
    text = (f"fastest {'fitting ' if not args.ignore_memory else ''}layout of the cost model (Eq 10): "
            f"{sizes.cfg.name}{dsa} ({sizes.dtype} weights) on {th.name}, B={args.batch}, "
            f"q={args.query_rows}; {kv_line(sizes)}\n" + table(rows, ["at", "from", "to", "cause"]) + tail)
    return emit(args, obj, text)


# ---- pd: the prefill-to-decode transfer -------------------------------------------------------------
def run_pd(args: argparse.Namespace) -> int:
    """`plan pd`: one request's transfer from the prefill group to the decode group (`core/pd.py`)."""
    from splash.core.pd import Group, blind_bytes, plan_pd
    from splash.core.presets import resolve_model_config

    cfg = resolve_model_config(args.model)
    need(args.context, "--context")
    need(args.page_size, "--page-size")
    pages = -(-args.context // args.page_size)
    if pages * max(args.prefill_tp, args.decode_tp) > MAX_PAGES:
        raise ConfigError(f"--context {args.context:,} is {pages:,} pages of {args.page_size}: more than a "
                          "manifest is built for; raise --page-size")
    src = Group(Layout.parse(args.prefill_layout), args.prefill_tp, args.prefill_owner)
    dst = Group(Layout.parse(args.decode_layout), args.decode_tp, args.decode_owner)
    kw = dict(kv_format=args.kv_dtype, dtype=args.dtype, state=args.state_dtype)
    m = plan_pd(cfg, src, dst, args.context, args.page_size, fill=not args.no_fill, **kw)
    blind = blind_bytes(cfg, src, dst, args.context, args.page_size, **kw)
    ratio = blind / m.link_bytes if m.link_bytes else None
    obj = {"model": cfg.name, "dtype": args.dtype, "kv_dtype": args.kv_dtype, "fill": not args.no_fill,
           **m.to_json(moves=args.moves), "blind_bytes": blind, "blind_ratio": ratio}
    rows = [[f"prefill {r}", f"{b:,}", "", "", ""] for r, b in enumerate(m.send)]
    rows += [[f"decode {r}", "", f"{lr:,}", f"{fr:,}", f"{fs:,}"]
             for r, (lr, fr, fs) in enumerate(zip(m.link_recv, (a - b for a, b in zip(m.recv, m.link_recv)),
                                                  m.fill_send))]
    mib = lambda b: f"{b:,} bytes ({b / MIB:,.2f} MiB)"  # noqa: E731
    heads = "".join(f", {k} {v:,} a head" for k, v in m.head_bytes.items())
    text = (f"{cfg.name}: prefill {src.layout.label} T={src.ranks} -> decode {dst.layout.label} "
            f"T={dst.ranks}, context {args.context:,} ({m.num_pages:,} pages of {args.page_size}, "
            f"{m.page_bytes:,} bytes a page{heads})\n"
            + table(rows, ["rank", "link send", "link recv", "fill recv", "fill send"])
            + f"\nlink: {mib(m.link_bytes)}; fill inside the decode group: {mib(m.fill_bytes)}"
            + "\nlayout-blind (every prefill rank sends all it holds to each decode rank needing any): "
            + mib(blind) + (f", {ratio:.2f}x the link" if ratio is not None else "")
            + f"\n{m.note}")
    return emit(args, obj, text)


# ---- capacity -------------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    from splash.argtypes import output_file

    p = sub.add_parser("plan", help="analytical planner: weights, switches, crossovers, capacity, advise",
                       description="Answer layout questions from the ownership and cost models (no GPU).")
    kinds = p.add_subparsers(dest="plan_kind", metavar="KIND")

    w = kinds.add_parser("weights", help="projection bytes per layer and per switch (appendix A)")
    add_model_args(w)
    w.set_defaults(func=run_weights)

    s = kinds.add_parser("switches", help="primitive and bytes of all 12 directed switches")
    add_model_args(s)
    s.add_argument("--batch", "-B", type=int, default=16, help="requests in the batch (default 16)")
    s.add_argument("--context", "-s", type=int, default=131072, help="context tokens per request")
    s.add_argument("--page-size", type=int, default=PAPER_PAGE_SIZE,
                   help="KV page size (CP: page j on rank j %% T)")
    s.set_defaults(func=run_switches)

    c = kinds.add_parser("crossovers", help="where the fastest layout changes: the illustrative law, or "
                         "the cost model of a --model")
    c.add_argument("--scenario", default="b200", help="b200 | h200 | dcu (alpha of Eq 12)")
    c.add_argument("--lo-k", type=float, default=1.0, help="scan from (units of 1024 tokens)")
    c.add_argument("--hi-k", type=float, default=512.0, help="scan to (units of 1024 tokens)")
    c.add_argument("--limits", choices=("none", "paper", "sampled"), default="none",
                   help="mask layouts beyond their KV limit: the paper's, or sampled now (slower)")
    c.add_argument("--plot", metavar="FILE", type=output_file, help="write a PNG like the paper's Figure 1")
    add_model_args(c, dtype_default="auto", model_default=None)
    c.add_argument("--gpu", default="h200", help="with --model: hardware profile h200 | b200 | dcu | cpu")
    c.add_argument("--theta", metavar="FILE", help="with --model: calibrated theta JSON (overrides --gpu)")
    c.add_argument("--batch", "-B", type=int, default=32, help="with --model: running requests (default 32)")
    c.add_argument("--query-rows", "-q", type=int, default=1,
                   help="with --model: rows per request (1 = decode)")
    c.add_argument("--memory-fraction", type=float, help="with --model: share of device memory to use")
    c.add_argument("--memory-gib", type=float, help="with --model: device memory per rank (profile default)")
    c.add_argument("--page-size", type=int, default=PAPER_PAGE_SIZE,
                   help="with --model: KV page size (default 64)")
    c.add_argument("--ignore-memory", action="store_true",
                   help="with --model: compare every layout, fitting or not")
    c.set_defaults(func=run_crossovers)

    k = kinds.add_parser("capacity", help="cohort-residency KV limits per layout (appendix B.1)")
    k.add_argument("--scenario", help="h200 | dcu | b200 (the paper's scenarios)")
    k.add_argument("--pool-tokens", help="per-rank pools, e.g. TP=1000832,DP=686144,CP=724736,DOP=948352")
    k.add_argument("--memory-gib", type=float, help="per-rank budget for attention weights + KV (GiB)")
    k.add_argument("--weights-gib", type=float, help="full attention weights W_A (GiB)")
    k.add_argument("--kv-bytes-per-token", type=float, help="KV bytes per token over all layers")
    k.add_argument("--model", help="preset or checkpoint: its W_A and KV bytes per token (alone: pools from "
                                   "the --gpu profile's memory less the model's weights)")
    k.add_argument("--dtype", default="auto",
                   help="with --model: weight dtype bf16|fp8|...|auto (default auto)")
    k.add_argument("--kv-dtype", default="bf16", help=f"with --model: {KV_DTYPE_HELP}")
    k.add_argument("--fp8-scales", action="store_true", help="with --model: count FP8 128x128 block scales")
    k.add_argument("--gpu", default="h200", help="with --model alone: hardware profile (default h200)")
    k.add_argument("--memory-fraction", type=float, help="with --model alone: share of device memory to use")
    k.add_argument("--reserve-gib", type=float, default=0.0, help="reserve taken from the budget (GiB)")
    k.add_argument("--batch", "-B", type=int, help="requests per cohort (scenario default)")
    k.add_argument("--ranks", "-T", type=int, help="ranks (scenario default)")
    k.add_argument("--cohorts", type=int, default=200_000, help="cohorts sampled per length (default 200000)")
    k.add_argument("--seed", type=int, default=20260922, help="PCG64 seed (default 20260922)")
    k.add_argument("--residency", type=float, default=0.99, help="all-rank residency target (default 0.99)")
    k.add_argument("--output-min", type=int, default=512, help="shortest requested output (default 512)")
    k.add_argument("--output-max", type=int, default=1024, help="longest requested output (default 1024)")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    k.set_defaults(func=run_capacity)

    a = kinds.add_parser("advise", help="which layout the policy would run for a batch, and why")
    add_model_args(a, dtype_default="auto")
    a.add_argument("--gpu", default="h200", help="hardware profile: h200 | b200 | dcu | cpu (default h200)")
    a.add_argument("--theta", metavar="FILE", help="calibrated theta JSON (overrides --gpu)")
    a.add_argument("--batch", "-B", type=int, default=32, help="running requests (default 32)")
    a.add_argument("--context", "-s", type=int, default=8192, help="live context per request (default 8192)")
    a.add_argument("--query-rows", "-q", type=int, default=1, help="rows per request this step (1 = decode)")
    a.add_argument("--current", default="none", help="layout running now (none: a fresh start)")
    a.add_argument("--margin", type=float, default=0.05, help="relative switching margin (default 0.05)")
    a.add_argument("--memory-fraction", type=float, help="share of device memory to use (profile default)")
    a.add_argument("--memory-gib", type=float, help="device memory per rank (profile default)")
    a.add_argument("--page-size", type=int, default=PAPER_PAGE_SIZE, help="KV page size (default 64)")
    a.add_argument("--speculative-depth", type=int, default=0,
                   help="also price speculative decoding at depths 0..K in the chosen layout (the depth "
                        "policy's choice for this batch)")
    a.add_argument("--speculative-accept", type=float, default=0.7, help="per-draft acceptance (default 0.7)")
    a.add_argument("--speculative-draft-layers", type=int, default=1,
                   help="MTP layers a draft runs through (default 1; 0: n-gram drafts)")
    a.set_defaults(func=run_advise)

    d = kinds.add_parser("pd", help="one request's prefill-to-decode transfer: bytes each rank sends and "
                         "receives, against a layout-blind transfer")
    d.add_argument("--model", default="deepseek-v3", help=f"preset ({', '.join(PRESETS)}), checkpoint dir, "
                   "config.json (default deepseek-v3)")
    d.add_argument("--prefill-layout", default="tp", help="the prefill group's layout tp|dp|cp|dop")
    d.add_argument("--prefill-tp", type=int, default=2, help="ranks of the prefill group (default 2)")
    d.add_argument("--prefill-owner", type=int, default=0, help="the request's owner rank there (DP/DOP)")
    d.add_argument("--decode-layout", default="dp", help="the decode group's layout tp|dp|cp|dop")
    d.add_argument("--decode-tp", type=int, default=2, help="ranks of the decode group (default 2)")
    d.add_argument("--decode-owner", type=int, default=0, help="the request's owner rank there (DP/DOP)")
    d.add_argument("--context", "-s", type=int, default=8192, help="prompt tokens of the request")
    d.add_argument("--page-size", type=int, default=PAPER_PAGE_SIZE, help="KV page size (default 64)")
    d.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="auto",
                   help="auto (the activations' dtype) or " + KV_DTYPE_HELP)
    d.add_argument("--dtype", default="bf16", help="model dtype bf16|fp16|fp8|fp32|fp64 (default bf16)")
    d.add_argument("--state-dtype", help="KDA recurrent state dtype (default fp32, fp64 for fp64)")
    d.add_argument("--no-fill", action="store_true", help="send every replica over the link instead of "
                   "completing a replicated decode layout inside its group")
    d.add_argument("--moves", action="store_true", help="with --json: list every move")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=run_pd)

    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])
