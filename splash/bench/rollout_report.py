"""`splash bench rollout`'s report: the table of each run (per phase, against the oracle bound) and the
timeline plot with every switch marked (splash/bench/rollout.py runs it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from splash.bench.report import save_figure
from splash.step.plan import LAYOUTS


def table(doc: dict[str, Any]) -> str:
    w, c = doc["workload"], doc["config"]
    lines = [f"bench rollout: T={c['tp']} {c['model']} {c['dtype']}, {w['requests']} requests started "
             f"together (prompts {w['prompt_tokens']} tokens, outputs {w['output_tokens']}: median "
             f"{w['median_output']:.0f}, longest {w['longest_output']}), "
             f"{c['memory_per_rank'] / 2**20:.1f} MiB per rank",
             f"{'run':>5} {'KV tok/rank':>11} {'distinct':>8} {'max run':>7} {'makespan s':>10} "
             f"{'gen tok/s':>9} {'steps':>6} {'preempt':>7} {'switches':>8}"]
    for name, r in doc["runs"].items():
        lines.append(f"{name:>5} {r['kv_pool_tokens_per_rank'][0]:>11} {r['kv_distinct_tokens']:>8} "
                     f"{r['max_running']:>7} {r['makespan_s']:>10.2f} {r['throughput_tok_s']:>9.1f} "
                     f"{r['steps']:>6} {r['preemptions']:>7} {r['switches']:>8}")
    if doc.get("auto_vs_best_fixed"):
        a = doc["runs"]["auto"]
        path = " ".join(f"{e['step']}:{e['src']}->{e['dst']}{' (back)' if e['cause'] == 'guard' else ''}"
                        for e in a["switch_events"] if not e["refused"])
        rep = _each(doc.get("auto_vs_best_fixed_each"))
        tot = doc.get("auto_vs_best_fixed_of_totals")
        rep += f"; {tot:.2f}x of the repeats' total times" if tot is not None and rep else ""
        lines.append(f"auto / best fixed ({doc['best_fixed']}): {doc['auto_vs_best_fixed']:.2f}x{rep}; auto "
                     f"switched {path or 'never'}; {a['refusals']} refused, {a.get('switch_backs', 0)} "
                     "switched back")
        if doc.get("auto_vs_oracle_gated"):
            own, each = doc.get("auto_vs_oracle_gated_own_choice"), doc.get("auto_vs_oracle_gated_each") or []
            tot = doc.get("auto_vs_oracle_gated_of_totals")
            lines.append(f"auto / gated per-phase oracle: {doc['auto_vs_oracle_gated']:.2f}x{_each(each)}"
                         + (f"; {tot:.2f}x of the repeats' total times" if tot is not None and len(each) > 1
                            else "")
                         + (f"; {own:.2f}x where each repeat's oracle chooses by its own runs alone"
                            if own is not None and len(each) > 1 else ""))
        if a.get("theta_correction"):
            from splash.core.correction import describe

            lines.append(f"auto's prior: {a.get('theta_source')}; online correction (measured / predicted): "
                         f"{describe(a['theta_correction'])}")
    if doc.get("phases"):
        from splash.bench.phases import lines as phase_lines

        lines += phase_lines(doc["phases"])
    if doc.get("speculation"):
        lines += spec_lines(doc["speculation"])
    return "\n".join(lines)


def spec_lines(spec: dict[str, Any]) -> list[str]:
    """Speculation by phase: each run's wide and tail phase (seconds, generated tok/s, mean depth)."""
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = ["speculation by phase (wide: while requests wait; tail: after):",
           f"{'run':>18} {'makespan s':>10} {'tok/s':>7} {'wide s':>7} {'wide tok/s':>10} {'depth':>5} "
           f"{'tail s':>7} {'tail tok/s':>10} {'depth':>5} {'accept len':>10}"]
    for name, r in spec.items():
        out.append(f"{name:>18} {r['makespan_s']:>10.2f} {r['throughput_tok_s']:>7.1f} {r['wide_s']:>7.2f} "
                   f"{f(r['wide_tok_s'], '.1f'):>10} {f(r['wide_mean_depth'], '.1f'):>5} {r['tail_s']:>7.2f} "
                   f"{f(r['tail_tok_s'], '.1f'):>10} {f(r['tail_mean_depth'], '.1f'):>5} "
                   f"{f(r.get('spec_accept_length'), '.2f'):>10}")
    return out


def _each(xs: list[float] | None) -> str:
    """' (median of 3 repeats: 1.01, 0.97, 1.04)' when there were several repeats."""
    xs = xs or []
    return f" (median of {len(xs)} repeats: {', '.join(f'{x:.2f}' for x in xs)})" if len(xs) > 1 else ""


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {name: i for i, name in enumerate(LAYOUTS)}
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for name, r in doc["runs"].items():
        tl = r["timeline"]
        if not tl:
            continue
        t = np.array([x["t"] for x in tl])
        lw = 2.2 if name == "auto" else 1.0
        axes[0].step(t, [order[x["layout"]] + (0.08 if name == "auto" else 0) for x in tl], where="post",
                     label=name, lw=lw)
        backs = [(x["t"], order[x["layout"]]) for x in tl if x.get("switch_back")]
        if backs:
            axes[0].scatter([b[0] for b in backs], [b[1] + 0.08 for b in backs], marker="x", s=60,
                            color="red", zorder=5, label=f"{name}: switch back")
        axes[1].plot(t, [x["running"] for x in tl], label=name, lw=lw)
        tok = np.array([x["tokens"] for x in tl], dtype=float)
        dt = np.diff(np.concatenate([[0.0], t]))
        k = max(1, min(10, len(tl)))  # ~10-step moving window
        rate = np.convolve(tok, np.ones(k), "same") / np.maximum(np.convolve(dt, np.ones(k), "same"), 1e-9)
        axes[2].plot(t, rate, label=name, lw=lw)
    axes[0].set_yticks(list(order.values()), [k.upper() for k in order])
    axes[0].set_ylabel("layout")
    axes[1].set_ylabel("running requests")
    axes[2].set_ylabel("generated tokens/s")
    axes[2].set_xlabel("time since the batch started (s)")
    axes[0].legend(ncol=5, fontsize=8)
    c = doc["config"]
    ratio = doc.get("auto_vs_best_fixed")
    extra = f"; auto = {ratio:.2f}x best fixed ({doc['best_fixed']})" if ratio else ""
    axes[0].set_title(f"rollout timeline, T={c['tp']}{extra}")
    save_figure(fig, path, dpi=110)
