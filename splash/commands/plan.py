"""`splash plan weights|switches|crossovers|capacity|advise`: the analytical core on the command line.

Every subcommand prints a readable table, or exactly one JSON object with --json. Bad input
raises ConfigError, which `splash.cli` turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from splash.core.config import PRESETS, ConfigError, ModelConfig, normalize_dtype, resolve_model_config
from splash.core.layouts import DIRECTIONS, LAYOUTS, Layout, longest_balanced_context
from splash.core.sizes import GIB, MIB, AttentionSizes

# Presets whose published checkpoints are FP8 (GLM-5: zai-org/GLM-5-FP8, the precision the paper serves
# GLM-5 in; its BF16 weights alone overflow an H200 at T = 8).
FP8_NATIVE = ("deepseek-v3", "deepseek-v3.2", "kimi-k2", "glm-5")
KV_DTYPE_HELP = ("KV dtype: bf16 (2 bytes a value, default), fp8 (the paper's layout: FP8 latent and "
                 "indexer key with a float32 scale per 128 values, BF16 rotary key), fp16, fp32, fp64")


# ---- shared helpers (also used by `splash simulate`) ----------------------------------------------
def emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> int:
    print(json.dumps(obj, default=float) if args.json else text)
    return 0


MAX_PAGES = 2**22  # plan switches: rows of one manifest (B x pages per request)
MAX_SCAN_K = 16384.0  # plan crossovers: --hi-k, in 1024 tokens


def need(value: float | int, name: str, minimum: float = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value:g}")


def weight_dtype(cfg: ModelConfig, dtype: str | None) -> str:
    """`auto`: FP8 where the published checkpoint is FP8 (`FP8_NATIVE`, or its config says so), else bf16."""
    if dtype in (None, "auto"):
        q = cfg.quantization_config or {}
        fp8 = cfg.name in FP8_NATIVE or (isinstance(q, dict) and q.get("quant_method") == "fp8")
        return "fp8" if fp8 else "bf16"
    return normalize_dtype(dtype)


def add_model_args(p: argparse.ArgumentParser, dtype_default: str = "bf16",
                   model_default: str | None = "deepseek-v3", ranks_default: int | None = 8) -> None:
    p.add_argument("--model", default=model_default,
                   help=f"preset ({', '.join(PRESETS)}), checkpoint dir, config.json"
                        + (f" (default {model_default})" if model_default else ""))
    p.add_argument("--ranks", "-T", type=int, default=ranks_default,
                   help="ranks T in the attention group"
                        + (f" (default {ranks_default})" if ranks_default else ""))
    p.add_argument("--dtype", default=dtype_default,
                   help=f"weight dtype bf16|fp16|fp8|fp32|auto (default {dtype_default})")
    p.add_argument("--kv-dtype", default="bf16", help=KV_DTYPE_HELP)
    p.add_argument("--fp8-scales", action="store_true", help="count FP8 128x128 block scales (fp32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def sizes_from(args: argparse.Namespace, ranks: int | None = None) -> AttentionSizes:
    cfg = resolve_model_config(args.model)
    T = args.ranks if ranks is None else ranks
    need(T, "--ranks")
    cfg.check_ranks(T)
    return AttentionSizes(cfg, weight_dtype(cfg, args.dtype), args.kv_dtype, args.fp8_scales)


def kv_summary(sizes: AttentionSizes) -> dict[str, Any]:
    """KV bytes per token of a model (the core's one rule, `splash.core.sizes`), for JSON output."""
    per_layer = sizes.kv_layer_bytes
    kinds = sorted(set(per_layer), reverse=True)
    return {"kv_dtype": sizes.kv_dtype, "kv_bytes_per_token": sizes.k,
            "kv_bytes_per_token_layer": {f"{b:g}": per_layer.count(b) for b in kinds}}


def kv_line(sizes: AttentionSizes) -> str:
    """'KV fp8: 48,068 bytes per token (788 per layer x 61 layers)': what one context token costs."""
    per_layer = sizes.kv_layer_bytes
    parts = [f"{b:,g} per layer x {per_layer.count(b)} layers"
             for b in sorted(set(per_layer), reverse=True) if b]  # (a hybrid's KDA layers hold no KV)
    return f"KV {sizes.kv_dtype}: {sizes.k:,.0f} bytes per token ({' + '.join(parts)})"


def state_summary(sizes: AttentionSizes) -> dict[str, Any]:
    """A hybrid's per-request KDA state (the core's rule, `splash.core.stores`), for JSON output."""
    if not sizes.cfg.is_hybrid:
        return {}
    return {"mla_layers": len(sizes.mla_layers), "kda_layers": len(sizes.kda_layers),
            "state_bytes_per_request": sizes.z, "state_bytes_per_request_layer": sizes.state_layer_bytes,
            "state_stores_per_layer": sizes.state_store_bytes()}


def state_line(sizes: AttentionSizes) -> str:
    """'; KDA state: 43,417,600 bytes per request (2,170,880 per layer x 20 KDA layers)', or ''."""
    if not sizes.cfg.is_hybrid:
        return ""
    return (f"; KDA state: {sizes.z:,.0f} bytes per request ({sizes.state_layer_bytes:,.0f} per layer x "
            f"{len(sizes.kda_layers)} KDA layers, whatever the context)")


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def parse_layout_map(text: str, what: str) -> dict[Layout, float]:
    """'TP=1000,DP=2000,CP=..,DOP=..' -> {Layout: value}; all four layouts required."""
    out: dict[Layout, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ConfigError(f"{what}: expected LAYOUT=VALUE pairs like TP=1000832, got {part!r}")
        k, v = part.split("=", 1)
        try:
            out[Layout.parse(k)] = float(v)
        except ValueError:
            raise ConfigError(f"{what}: {v!r} is not a number") from None
    missing = [lay.label for lay in LAYOUTS if lay not in out]
    if missing:
        raise ConfigError(f"{what}: missing {', '.join(missing)} (give all of TP, DP, CP, DOP)")
    if any(v < 0 for v in out.values()):
        raise ConfigError(f"{what}: values must be >= 0")
    return out


# ---- weights --------------------------------------------------------------------------------------
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


# ---- capacity -------------------------------------------------------------------------------------
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
    from splash.core.costmodel import Theta

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
    return emit(args, obj, text)


# ---- registration ---------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    from splash.commands.argtypes import output_file

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
    s.add_argument("--page-size", type=int, default=64, help="KV page size (CP: page j on rank j %% T)")
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
    c.add_argument("--page-size", type=int, default=64, help="with --model: KV page size (default 64)")
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
    a.add_argument("--page-size", type=int, default=64, help="KV page size (default 64)")
    a.set_defaults(func=run_advise)

    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])
