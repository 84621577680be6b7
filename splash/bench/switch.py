"""`splash bench switch`: the paper's Table 1 protocol on this machine, for all 12 directions.

One engine on T ranks holds a decoding batch of B requests at context S. For every direction a->b
and every repeat, three kinds of decode step are timed (each a whole engine step: plan, the T ranks'
forward, sampling):
  ready       - a step in b with b's state already resident (the target-ready time T_ready);
  blocking    - the step that switches a->b moving every layer's state first, then computing;
  overlapped  - the step that switches a->b computing layer i while layer i+1's state moves.
Overhead dT = T - T_ready (p50 over repeats; p95 for overlapped). Rank 0's CPU time (all its threads,
gloo's included) is taken over the same steps: `cpu_*_overhead` = the switching step's CPU minus the
ready step's, i.e. the work a switch adds that overlap can only hide where a core would otherwise idle.
Bytes moved are the switch plan's (= the analytical core's manifest, checked in tests/test_switch.py),
summed over ranks and layers.
The engine is taken back to `a` (an untimed switch) and given one untimed step before each timed
switch, so every timed step starts from the same state.

Drain-and-restart, what an engine without live switching needs: run the batch's remaining tokens to
completion in the old layout (`--remaining` decode steps, measured), then stop the ranks, start them
again and load the model in the new layout (measured).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import numpy as np

from splash.bench.report import report, save_figure
from splash.step.plan import LAYOUTS

DIRECTIONS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]


def register(kinds: argparse._SubParsersAction) -> None:
    from splash.argtypes import output_file, positive_int

    p = kinds.add_parser("switch", help="live switch cost per direction vs drain-and-restart (Table 1)",
                         description="Time target-ready, blocking and overlapped switching steps for all 12 "
                                     "directions, and the drain-and-restart baseline.")
    p.add_argument("--tp", type=positive_int, default=2, help="ranks T (default 2)")
    p.add_argument("--directions", type=directions, default=None, metavar="A-B,...",
                   help="only these directions, e.g. dp-tp,cp-tp (default: all 12)")
    p.add_argument("--batch", type=positive_int, default=8,
                   help="requests in the decoding batch B (default 8)")
    p.add_argument("--context", type=positive_int, default=2048, help="tokens of context per request S")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed switches per direction and mode")
    p.add_argument("--remaining", type=positive_int, default=32,
                   help="tokens each request still has to generate when drain-and-restart drains (32)")
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny'")
    p.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float64")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="FILE", type=output_file,
                   help="write a PNG of the overheads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def directions(text: str) -> list[tuple[str, str]]:
    """'dp-tp,cp-tp' -> [('dp', 'tp'), ('cp', 'tp')] (argparse type: a bad pair is one clear line)."""
    out = []
    for part in text.replace(" ", "").lower().split(","):
        a, _, b = part.partition("-")
        if (a, b) not in DIRECTIONS:
            raise argparse.ArgumentTypeError(f"{part!r} is not a direction; write FROM-TO pairs of "
                                             f"{', '.join(LAYOUTS)} with FROM != TO, e.g. dp-tp,cp-tp")
        out.append((a, b))
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _engine(args: argparse.Namespace, group: Any, layout: str, steps: int) -> Any:
    from splash.engine.build import build_engine

    P = args.page_size
    max_len = args.context + steps + args.remaining + 8
    pages = 2 * args.batch * -(-max_len // P) + 8  # TP replicas + a switch's source and destination
    return build_engine(args.model, dtype=args.dtype, tp=args.tp, layout=layout, rank_group=group,
                        num_kv_pages=pages, page_size=P, max_num_seqs=args.batch,
                        max_num_batched_tokens=max(512, min(4096, args.batch * args.context)),
                        max_model_len=max_len, device=args.device, seed=args.seed)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the protocol; the JSON document."""
    import torch

    from splash.engine.group import RankGroup
    from splash.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    dirs = args.directions or DIRECTIONS
    per_dir = 8  # engine steps per direction and repeat (timed and untimed)
    steps = (args.repeats + 1) * len(dirs) * per_dir + 16
    t_start = time.perf_counter()
    group = RankGroup.start(args.tp, device=args.device, threads=1)
    bar = None
    try:
        eng = _engine(args, group, "tp", steps)
        rng = random.Random(args.seed)
        vocab = eng.vocab_size or 256
        params = SamplingParams(temperature=0.0, max_tokens=steps + args.remaining + 4, ignore_eos=True)
        for i in range(args.batch):
            eng.add_request(f"b{i}", prompt_token_ids=[rng.randrange(vocab) for _ in range(args.context)],
                            params=params)
        t0 = time.perf_counter()
        while any(s.is_prefill for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        prefill_s = time.perf_counter() - t0
        sw = eng.switcher
        samples: dict[tuple[str, str], dict[str, list[float]]] = {
            d: {k: [] for k in ("ready", "blocking", "overlapped", "blocking_exposed", "overlapped_exposed",
                                "plan", "cpu_ready", "cpu_blocking", "cpu_overlapped")} for d in dirs}
        moved: dict[tuple[str, str], float] = {}

        cpu = [0.0]  # rank 0's process CPU seconds of the last timed step

        def timed() -> float:
            c, t = time.process_time(), time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            cpu[0] = time.process_time() - c
            return dt

        def go(layout: str, mode: str | None = None) -> float:
            if eng.allocator.layout != layout:
                sw.request(layout, mode)
            dt = timed()
            if eng.allocator.layout != layout:
                raise RuntimeError(f"switch to {layout} did not happen: {sw.events[-1].message}")
            return dt

        if not args.quiet:
            from splash.progress import progress_bar

            bar = progress_bar(args.repeats * len(dirs), "bench switch", "dir")
        for a, b in dirs:  # warm-up: every direction once in each mode (first uses of each path)
            go(a)
            go(b, "blocking")
            go(a)
            go(b, "overlapped")
        for _ in range(args.repeats):
            for a, b in dirs:
                got = samples[(a, b)]
                go(a)
                timed()  # settle in a
                got["blocking"].append(go(b, "blocking"))
                got["cpu_blocking"].append(cpu[0])
                ev = sw.events[-1]
                moved[(a, b)] = ev.bytes_per_layer * ev.layers
                got["blocking_exposed"].append(ev.exposed_s)
                got["plan"].append(ev.plan_s)
                go(a)
                timed()
                got["overlapped"].append(go(b, "overlapped"))
                got["cpu_overlapped"].append(cpu[0])
                got["overlapped_exposed"].append(sw.events[-1].exposed_s)
                got["plan"].append(sw.events[-1].plan_s)
                for _ in range(2):
                    got["ready"].append(timed())
                    got["cpu_ready"].append(cpu[0])
                if bar is not None:
                    bar.update(1)
        # Drain-and-restart from the last layout: finish the batch's remaining tokens, then restart.
        src = eng.allocator.layout
        dst = next(lay for lay in LAYOUTS if lay != src)
        t0 = time.perf_counter()
        for _ in range(args.remaining):
            eng.step()
        drain_s = time.perf_counter() - t0
        eng.abort_all()
        t0 = time.perf_counter()
        eng.shutdown()
        group.close()
        group = RankGroup.start(args.tp, device=args.device, threads=1)
        eng = _engine(args, group, dst, steps)
        restart_s = time.perf_counter() - t0
        eng.shutdown()
    finally:
        if bar is not None:
            bar.close()
        group.close()
    rows = []
    for d in dirs:
        s = samples[d]
        ready = _pct(s["ready"], 50)
        cpu_ready = _pct(s["cpu_ready"], 50)
        b_over = [x - ready for x in s["blocking"]]
        o_over = [x - ready for x in s["overlapped"]]
        rows.append({"from": d[0], "to": d[1], "bytes_moved": moved.get(d, 0.0),
                     "ready_p50_ms": ready * 1e3, "blocking_p50_ms": _pct(s["blocking"], 50) * 1e3,
                     "overlapped_p50_ms": _pct(s["overlapped"], 50) * 1e3,
                     "blocking_overhead_p50_ms": _pct(b_over, 50) * 1e3,
                     "overlapped_overhead_p50_ms": _pct(o_over, 50) * 1e3,
                     "overlapped_overhead_p95_ms": _pct(o_over, 95) * 1e3,
                     "blocking_overhead_p95_ms": _pct(b_over, 95) * 1e3,
                     # rank 0's own time inside the switch executor (transfers it waited on, installs) and
                     # in the planner: the switch's cost without the step-to-step noise of a busy machine
                     "blocking_exposed_p50_ms": _pct(s["blocking_exposed"], 50) * 1e3,
                     "overlapped_exposed_p50_ms": _pct(s["overlapped_exposed"], 50) * 1e3,
                     "plan_p50_ms": _pct(s["plan"], 50) * 1e3,
                     "cpu_ready_p50_ms": cpu_ready * 1e3,
                     "cpu_blocking_overhead_p50_ms": (_pct(s["cpu_blocking"], 50) - cpu_ready) * 1e3,
                     "cpu_overlapped_overhead_p50_ms": (_pct(s["cpu_overlapped"], 50) - cpu_ready) * 1e3})
    return {"directions": rows, "drain_restart_ms": (drain_s + restart_s) * 1e3, "drain_ms": drain_s * 1e3,
            "restart_ms": restart_s * 1e3, "drain_from": src, "restart_into": dst,
            "config": {"tp": args.tp, "batch": args.batch, "context": args.context, "repeats": args.repeats,
                       "remaining": args.remaining, "model": args.model, "dtype": args.dtype,
                       "page_size": args.page_size, "prefill_s": prefill_s,
                       "seconds": time.perf_counter() - t_start}}


def verdict(doc: dict[str, Any]) -> list[str]:
    """The acceptance checks of the protocol, as lines (benchmark findings, not assertions)."""
    out = []
    moving = [r for r in doc["directions"] if r["bytes_moved"] > 0]
    ratios = [(r["overlapped_overhead_p50_ms"] / r["blocking_overhead_p50_ms"]
               if r["blocking_overhead_p50_ms"] > 0 else float("inf"), r) for r in moving]
    bad = [f"{r['from']}->{r['to']} ({x:.0%})" for x, r in ratios if not x <= 0.25]
    out.append(f"overlapped overhead <= 25% of blocking in {len(moving) - len(bad)}/{len(moving)} "
               "directions that move bytes" + (f"; not in {', '.join(bad)}" if bad else ""))
    free = [r for r in doc["directions"] if r["bytes_moved"] == 0]
    out.append("no-byte directions (" + ", ".join(
        f"{r['from']}->{r['to']} {r['overlapped_overhead_p50_ms']:+.1f} ms" for r in free) + ")")
    worst = max(max(r["overlapped_overhead_p50_ms"], r["blocking_overhead_p50_ms"])
                for r in doc["directions"])
    out.append(f"worst live switch overhead {worst:.1f} ms = {worst / doc['drain_restart_ms']:.2%} of "
               f"drain-and-restart ({doc['drain_restart_ms']:.0f} ms: drain {doc['drain_ms']:.0f} + restart "
               f"{doc['restart_ms']:.0f})")
    return out


def table(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = [f"bench switch: T={c['tp']} B={c['batch']} context={c['context']} {c['dtype']}, {c['repeats']} "
             f"repeats; times in ms, overhead dT = step - target-ready; exp = rank 0's time inside the "
             "switch executor; plan = rank 0's planning; cpu = rank 0's CPU time the switch adds (ovl)",
             f"{'direction':>10} {'MB moved':>9} {'ready':>8} {'blocking':>9} {'overlap':>8} "
             f"{'dT block':>9} {'dT ovl p50 (p95)':>17} {'ovl/blk':>8} {'exp blk':>8} {'exp ovl':>8} "
             f"{'plan':>6} {'cpu':>6}"]
    for r in doc["directions"]:
        ratio = (r["overlapped_overhead_p50_ms"] / r["blocking_overhead_p50_ms"]
                 if r["bytes_moved"] > 0 and r["blocking_overhead_p50_ms"] > 0 else None)
        name = f"{r['from']}->{r['to']}"
        lines.append(f"{name:>10} {r['bytes_moved'] / 1e6:9.2f} {r['ready_p50_ms']:8.1f} "
                     f"{r['blocking_p50_ms']:9.1f} {r['overlapped_p50_ms']:8.1f} "
                     f"{r['blocking_overhead_p50_ms']:9.1f} {r['overlapped_overhead_p50_ms']:8.1f} "
                     f"({r['overlapped_overhead_p95_ms']:6.1f}) "
                     + (f"{ratio:8.0%}" if ratio is not None else f"{'-':>8}")
                     + f" {r.get('blocking_exposed_p50_ms', 0):8.1f}"
                     f" {r.get('overlapped_exposed_p50_ms', 0):8.1f} {r.get('plan_p50_ms', 0):6.1f}"
                     f" {r.get('cpu_overlapped_overhead_p50_ms', 0):6.1f}")
    lines.append(f"drain-and-restart {doc['drain_from']}->{doc['restart_into']}: "
                 f"{doc['drain_restart_ms']:.0f} ms (drain {c['remaining']} tokens {doc['drain_ms']:.0f} ms "
                 f"+ restart ranks {doc['restart_ms']:.0f} ms)")
    lines += [f"  {v}" for v in verdict(doc)]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["directions"]
    names = [f"{r['from']}\n->{r['to']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar(x - 0.2, [max(r["blocking_overhead_p50_ms"], 0.01) for r in rows], 0.4, label="blocking")
    ax.bar(x + 0.2, [max(r["overlapped_overhead_p50_ms"], 0.01) for r in rows], 0.4, label="overlapped",
           yerr=[[0] * len(rows), [max(0.0, r["overlapped_overhead_p95_ms"] - r["overlapped_overhead_p50_ms"])
                                   for r in rows]], capsize=2)
    ax.axhline(doc["drain_restart_ms"], color="k", ls="--", lw=1, label="drain-and-restart")
    ax.set_yscale("log")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("switch overhead dT (ms, p50; bar = p95)")
    c = doc["config"]
    ax.set_title(f"live switch overhead, T={c['tp']} B={c['batch']} S={c['context']} ({c['dtype']})")
    ax.legend()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    if args.tp < 2:
        print("splash bench switch: error: switching needs --tp 2 or more", file=sys.stderr)
        return 2
    return report("switch", args, measure, table, plot)
