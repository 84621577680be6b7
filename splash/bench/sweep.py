"""`splash bench sweep`: the paper's Figure 4 protocol on this machine - fixed layouts over a grid.

For every layout and every (input length, batch size) point, a batch of B random-token prompts of
L_in tokens is generated greedily to exactly L_out tokens (`ignore_eos`), and the total throughput
B * (L_in + L_out) / T_batch is reported; the best layout of each point is marked. The T ranks are
started once for the whole sweep and each layout is *loaded* onto them in turn (every rank rebuilds
its shard and KV pool for that layout; no process restarts), then reused across all points.
With --memory-per-rank every layout gets the pool its weights leave, so capacity-bound points show
queueing (and preemption) where a layout holds less KV.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from splash.bench.report import report, save_figure
from splash.step.plan import LAYOUTS


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _layouts(text: str) -> list[str]:
    vals = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [v for v in vals if v not in LAYOUTS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"layouts must be a comma-separated subset of {','.join(LAYOUTS)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(vals))


def register(kinds: argparse._SubParsersAction) -> None:
    from splash.argtypes import output_file, positive_int

    p = kinds.add_parser("sweep", help="throughput of each fixed layout over input lengths x batch sizes",
                         description="Figure 4 protocol: total throughput B*(L_in+L_out)/T_batch per layout.")
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny' (default)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float64 (default: per device)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    p.add_argument("--tp", "--ranks", dest="tp", type=positive_int, default=2, help="ranks T (default 2)")
    p.add_argument("--layouts", type=_layouts, default=list(LAYOUTS), help="default tp,dp,cp,dop")
    p.add_argument("--input-lens", type=_int_list, default=[128, 512], help="L_in values (default 128,512)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32], help="B values (default 1,8,32)")
    p.add_argument("--output-len", type=positive_int, default=32, help="L_out (default 32)")
    p.add_argument("--memory-per-rank", default=None, help="budget per rank for weights + KV, e.g. 2GiB")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="prefill chunk per step (default max(512, largest batch))")
    p.add_argument("--repeat", type=positive_int, default=1, help="timed runs per point; the fastest counts")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads per rank (default: cores/T)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="FILE", type=output_file,
                   help="write a PNG: throughput vs batch per L_in")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + input_len * 1009 + batch)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]


def run_point(eng: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Generate the batch to exactly `output_len` tokens each; time it and note queueing/preemption."""
    from splash.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    eng.flush_cache()  # points and repeats share seeded prompts: time prefill, not cached pages
    pre0, steps0 = eng.scheduler.num_preemptions, eng.steps
    max_running = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"sweep-{i}", prompt_token_ids=p, params=params)
    while eng.has_unfinished():
        eng.step(final_only=True)
        max_running = max(max_running, len(eng.scheduler.running))
    seconds = time.perf_counter() - t0
    b, l_in = len(prompts), len(prompts[0])
    return {"seconds": seconds, "tokens_per_s": b * (l_in + output_len) / seconds,
            "output_tokens_per_s": b * output_len / seconds, "steps": eng.steps - steps0,
            "preemptions": eng.scheduler.num_preemptions - pre0, "max_running": max_running}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Every layout x point; the rank group is started once and each layout loaded onto it."""
    from splash.engine.build import build_engine
    from splash.engine.group import RankGroup

    points = [(l_in, b) for l_in in args.input_lens for b in args.batch_sizes]
    max_b = max(args.batch_sizes)
    kw = dict(model=args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
              memory_per_rank=args.memory_per_rank, max_num_seqs=max_b,
              max_num_batched_tokens=args.max_num_batched_tokens or max(512, max_b),
              max_model_len=max(args.input_lens) + args.output_len + 1)
    group = None
    if args.tp > 1:
        group = RankGroup.start(args.tp, device=args.device, threads=args.threads)
    elif args.threads:
        import torch

        torch.set_num_threads(args.threads)
    bar = None
    if not args.no_progress:
        from splash.progress import progress_bar

        bar = progress_bar(len(args.layouts) * len(points), "sweep", "point")
    results: dict[tuple[int, int], dict[str, Any]] = {pt: {} for pt in points}
    pools: dict[str, Any] = {}
    try:
        for layout in args.layouts:
            eng = build_engine(layout=layout, tp=args.tp, rank_group=group, **kw)
            try:
                st = eng.stats()
                pools[layout] = {k: st[k] for k in ("kv_pool_tokens_per_rank", "kv_distinct_tokens",
                                                    "max_request_tokens")}
                vocab = eng.vocab_size or 256
                run_point(eng, _prompts(1, 8, vocab, args.seed), 2)  # warm-up
                for l_in, b in points:
                    if bar is not None:
                        bar.set_postfix_str(f"{layout} L_in={l_in} B={b}")
                    if l_in + args.output_len > eng.max_request_tokens:
                        results[(l_in, b)][layout] = {"error": "a request does not fit one owner/shard"}
                    else:
                        prompts = _prompts(b, l_in, vocab, args.seed)
                        best = None
                        for _ in range(args.repeat):
                            r = run_point(eng, prompts, args.output_len)
                            if best is None or r["seconds"] < best["seconds"]:
                                best = r
                        results[(l_in, b)][layout] = best
                    if bar is not None:
                        bar.update(1)
                info = {k: st[k] for k in ("model", "dtype", "device", "ranks")}
            finally:
                eng.shutdown()
    finally:
        if bar is not None:
            bar.close()
        if group is not None:
            group.close()
    rows = []
    for (l_in, b), res in results.items():
        ok = {lay: r["tokens_per_s"] for lay, r in res.items() if "tokens_per_s" in r}
        rows.append({"input_len": l_in, "batch": b, "output_len": args.output_len, "results": res,
                     "best": max(ok, key=ok.get) if ok else None})
    return {"engine": info, "tp": args.tp, "layouts": args.layouts, "memory_per_rank": args.memory_per_rank,
            "pools": pools, "points": rows}


def table(doc: dict[str, Any]) -> str:
    lays = doc["layouts"]
    e = doc["engine"]
    out = [f"sweep: {e['model']} {e['dtype']} on {e['device']}, T={doc['tp']}, L_out="
           f"{doc['points'][0]['output_len'] if doc['points'] else '-'}; total tokens/s "
           f"(B*(L_in+L_out)/T_batch), * = best"]
    out.append(f"{'L_in':>6}{'B':>5}" + "".join(f"{lay:>12}" for lay in lays))
    for row in doc["points"]:
        cells = []
        for lay in lays:
            r = row["results"].get(lay, {})
            if "tokens_per_s" not in r:
                cells.append(f"{'n/a':>12}")
                continue
            mark = "*" if row["best"] == lay else " "
            q = "q" if r["max_running"] < row["batch"] else " "  # part of the batch had to queue
            cells.append(f"{r['tokens_per_s']:>10.1f}{mark}{q}")
        out.append(f"{row['input_len']:>6}{row['batch']:>5}" + "".join(cells))
    out.append("q = the layout could not run the whole batch at once (KV capacity): it queued part of it")
    pools = doc.get("pools") or {}
    if pools:
        out.append("KV pool per rank (tokens): " + ", ".join(f"{lay} {p['kv_pool_tokens_per_rank'][0]}"
                                                             for lay, p in pools.items()))
    return "\n".join(out)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({r["input_len"] for r in doc["points"]})
    fig, axes = plt.subplots(1, len(lens), figsize=(4.2 * len(lens), 3.6), squeeze=False)
    for ax, l_in in zip(axes[0], lens):
        rows = [r for r in doc["points"] if r["input_len"] == l_in]
        for lay in doc["layouts"]:
            done = [r for r in rows if "tokens_per_s" in r["results"].get(lay, {})]
            xs = [r["batch"] for r in done]
            ys = [r["results"][lay]["tokens_per_s"] for r in done]
            ax.plot(xs, ys, marker="o", label=lay.upper())
        ax.set_xscale("log", base=2)
        ax.set_title(f"L_in = {l_in}")
        ax.set_xlabel("batch size B")
        ax.set_ylabel("total tokens / s")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    e = doc["engine"]
    fig.suptitle(f"{e['model']} on T={doc['tp']} ({e['device']}, {e['dtype']})")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    return report("sweep", args, sweep, table, plot)
