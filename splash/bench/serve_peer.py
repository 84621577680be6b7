"""`splash bench serve --peer vllm`: the same streamed load against `splash serve` and vLLM's OpenAI server.

Both servers load --model (a directory, 'tiny' or 'small') in bfloat16 on 127.0.0.1 at a free port, one
after the other (never both at once: they would share the cores): start, wait for /v1/models, run the
load of `splash bench serve` (default 64 streamed completions, 128 prompt + 128 new tokens, concurrency
16, ignore_eos), stop the server by its process id (its whole process group), always, also on an error
or Ctrl-C. Prints each server's table, then the side-by-side metrics and splash / vLLM ratios; --json
prints one object; --plot draws every inter-token latency against time for both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from typing import Any

from splash.bench.report import save_figure

# (key in a summary, label, higher is better): the side-by-side rows
METRICS = (("output_throughput", "output tok/s", True), ("mean_ttft_ms", "mean TTFT, ms", False),
           ("mean_tpot_ms", "mean TPOT, ms", False), ("p99_itl_ms", "P99 inter-token latency, ms", False),
           ("max_itl_ms", "max inter-token latency, ms", False))


def add_peer_args(p: argparse.ArgumentParser) -> None:
    from splash.argtypes import output_file, positive_float, positive_int
    from splash.bench.peer import PEERS
    from splash.step.plan import LAYOUTS

    p.add_argument("--peer", choices=PEERS, default=None,
                   help="start `splash serve` and this peer's server (vllm: vLLM's OpenAI server from "
                        "`make peer-venv`) on --model, run the load against each in turn, print both")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="with --peer: ranks of both servers (vLLM's --tensor-parallel-size)")
    p.add_argument("--layout", default=None, choices=(*LAYOUTS, "auto"),
                   help="with --peer: splash's attention layout (default: splash serve's)")
    p.add_argument("--dtype", default="bfloat16", help="with --peer: both servers' dtype (default bfloat16)")
    p.add_argument("--startup-timeout", type=positive_float, default=900.0,
                   help="with --peer: seconds each server may take to come up (vLLM's first start "
                        "compiles for ~100 s)")
    p.add_argument("--peer-kv-gib", type=positive_float, default=2.0,
                   help="with --peer: the peer's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, default 2)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="with --peer: run splash then the peer this many times, alternating; the ratios "
                        "are the per-metric medians over rounds, each round's listed (default 1)")
    p.add_argument("--plot", default=None, metavar="FILE", type=output_file,
                   help="with --peer: write the inter-token latency over time of both servers (PNG)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="with --peer: both servers' prefix cache on or off (default: on for --workload "
                        "grpo|multiturn, else each server's own default)")


def check_args(a: argparse.Namespace) -> str | None:
    """A one-line problem with the side-by-side flags, or None."""
    if not a.peer:
        if a.plot or a.layout or a.tp != 1 or a.rounds != 1:
            return ("--plot, --layout, --tp and --rounds go with --peer vllm (without it, load-test a "
                    "running server)")
        return None
    if a.base_url is not None:
        return "--peer starts both servers itself; drop --base-url"
    if not a.model:
        return "--peer needs --model: the checkpoint both servers load (a directory, 'tiny' or 'small')"
    if a.vocab_size is not None:
        return "--peer draws prompt ids from --model's vocabulary; drop --vocab-size"
    return None


def splash_command(a: argparse.Namespace, port: int, name: str) -> list[str]:
    cmd = [sys.executable, "-m", "splash.cli", "serve", "--model", a.model, "--dtype", a.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name]
    if (a.max_concurrency or a.num_prompts) > 64:  # (splash serve's default running batch is 64)
        cmd += ["--max-num-seqs", str(a.max_concurrency or a.num_prompts)]
    if a.tp > 1:
        cmd += ["--tp", str(a.tp)]
    if a.layout:
        cmd += ["--layout", a.layout]
    if a.api_key:
        cmd += ["--api-key", a.api_key]
    on = _prefix_caching(a)
    if on is not None:
        cmd += ["--enable-prefix-caching" if on else "--no-enable-prefix-caching"]
    return cmd + ["--num-kv-pages", str(kv_pages_like_peer(a))]


def _prefix_caching(a: argparse.Namespace) -> bool | None:
    """Both servers' prefix cache: as asked, else on for the prefix-sharing workloads."""
    on = getattr(a, "prefix_caching", None)
    if on is None and getattr(a, "workload", "random") != "random":
        on = True
    return on


def kv_pages_like_peer(a: argparse.Namespace) -> int:
    """splash's KV pool per rank in pages of `splash serve`'s size, holding the bytes the peer is given
    (--peer-kv-gib, vLLM's KV space per rank): at high concurrency the smaller pool would preempt and
    measure the pool, not the engine. (splash serve's own CPU default is 128 MiB, docs/runtime.md.)"""
    import torch

    from splash.config import EngineConfig
    from splash.core.model_config import ModelConfig
    from splash.kv.pool import KVPool
    from splash.model import resolve_model_path

    page = EngineConfig().page_size
    cfg = ModelConfig.from_hf(resolve_model_path(a.model))
    return KVPool.pages_for_budget(cfg, int(a.peer_kv_gib * 2**30), page, torch.bfloat16)


def vllm_command(a: argparse.Namespace, py: str, path: str, port: int, name: str) -> list[str]:
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--served-model-name", name,
           "--dtype", a.dtype, "--host", "127.0.0.1", "--port", str(port)]
    if a.tp > 1:
        cmd += ["--tensor-parallel-size", str(a.tp)]
    if a.api_key:
        cmd += ["--api-key", a.api_key]
    on = _prefix_caching(a)
    if on is not None:
        cmd += ["--enable-prefix-caching" if on else "--no-enable-prefix-caching"]
    return cmd


def measure(a: argparse.Namespace) -> dict[str, Any]:
    from splash.bench.peer import free_port, peer_env, peer_python
    from splash.core.model_config import ModelConfig, normalize_dtype
    from splash.model import resolve_model_path

    py = peer_python()  # before anything starts
    if normalize_dtype(a.dtype) != "bf16":
        raise ValueError("--peer vllm compares in bfloat16 (vLLM's CPU MLA kernel takes bf16 only)")
    path = resolve_model_path(a.model)
    a.vocab_size = ModelConfig.from_hf(path).vocab_size
    name = os.path.basename(os.path.normpath(a.model))
    env = dict(os.environ)
    port = free_port()
    doc: dict[str, Any] = {"model": a.model, "dtype": a.dtype, "tp": a.tp, "layout": a.layout,
                           "num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
                           "max_concurrency": a.max_concurrency, "peer": a.peer,
                           "long_input_len": a.long_input_len if a.long_fraction > 0 else None,
                           "long_fraction": a.long_fraction}
    rounds = []
    for _ in range(a.rounds):  # alternating, so a drift of the machine's speed hits both servers
        port = free_port()
        mine = serve_and_load(a, splash_command(a, port, name), env, port, "splash serve")
        port = free_port()
        peer_cmd = vllm_command(a, py, path, port, name)
        theirs = serve_and_load(a, peer_cmd, peer_env(a.tp, a.peer_kv_gib, python=py), port, "vLLM server")
        rounds.append({"splash": mine, "vllm": theirs, "ratios": ratios(mine, theirs)})
    doc["rounds"] = [{"ratios": r["ratios"],
                      **{k: {m: r[k][m] for m, _, _ in METRICS} for k in ("splash", "vllm")}} for r in rounds]
    doc["ratios"] = {m: _median([r["ratios"][m] for r in rounds]) for m, _, _ in METRICS}
    # the round whose throughput ratio is the median stands for the tables and the plot
    mid = sorted(rounds, key=lambda r: r["ratios"]["output_throughput"] or 0.0)[(len(rounds) - 1) // 2]
    doc["splash"], doc["vllm"] = mid["splash"], mid["vllm"]
    return doc


def _median(xs: list[float | None]) -> float | None:
    """The median of the ratios that exist (None where a peer metric was 0)."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def serve_and_load(a: argparse.Namespace, cmd: list[str], env: dict[str, str], port: int, what: str
                   ) -> dict[str, Any]:
    """Start one server, wait until it lists its model, run the load, stop it by its process id."""
    import httpx

    from splash.bench.load import benchmark
    from splash.bench.peer import PeerProcess, wait_until

    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    with PeerProcess(cmd, env=env, name=what) as proc:
        ready = lambda: httpx.get(url + "/v1/models", headers=headers, timeout=5).status_code == 200  # noqa: E731
        startup = wait_until(ready, proc, a.startup_timeout, what)
        a.base_url = url
        try:
            asyncio.run(benchmark(warmup_args(a)))  # first-use costs (first steps, lazy inits) untimed
            out = asyncio.run(benchmark(a))
        finally:
            a.base_url = None
        out["startup_s"] = startup
        out["server_pid"] = proc.pid
        out["server_log"] = proc.log_path
    return out


def warmup_args(a: argparse.Namespace) -> argparse.Namespace:
    """A short untimed load before the measured one: one full batch of prompts (other ids), 4 new tokens."""
    conc = a.max_concurrency or a.num_prompts
    return argparse.Namespace(**{**vars(a), "num_prompts": min(conc, a.num_prompts), "output_len": 4,
                                 "seed": a.seed + 1_000_003, "disable_tqdm": True, "peer": None})


def ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """splash / vLLM per metric (for throughput above 1 is better; for latencies below 1 is)."""
    return {k: (mine[k] / theirs[k] if theirs.get(k) else None) for k, _, _ in METRICS}


def table(doc: dict[str, Any]) -> str:
    from splash.bench.load import format_table

    parts = []
    for key, title in (("splash", "splash"), ("vllm", "vLLM CPU")):
        body = format_table(doc[key]).splitlines()
        parts.append(f"{title} (server up in {doc[key].get('startup_s', 0):.0f} s)\n" + "\n".join(body))
    lay = f", layout {doc['layout']}" if doc.get("layout") else ""
    if doc.get("long_fraction"):
        lay += f"; {doc['long_fraction']:g} of the prompts {doc['long_input_len']} tokens"
    head = (f"serve, splash vs vLLM CPU: {doc['model']} {doc['dtype']}, {doc['tp']} rank(s){lay}; "
            f"{doc['num_prompts']} streamed completions of {doc['input_len']} + {doc['output_len']} tokens "
            f"at concurrency {doc['max_concurrency']}, ignore_eos")
    multi = len(doc.get("rounds") or []) > 1
    what = f"median of {len(doc['rounds'])} rounds" if multi else "splash / vLLM"
    lines = [head, f"| metric | splash | vLLM CPU | {what} |" + (" each round |" if multi else ""),
             "|---|---|---|---|" + ("---|" if multi else "")]
    for k, label, _ in METRICS:
        r = doc["ratios"][k]
        row = (f"| {label} | {doc['splash'][k]:.1f} | {doc['vllm'][k]:.1f} | "
               f"{'-' if r is None else f'{r:.2f}x'} |")
        if multi:
            each = [x["ratios"][k] for x in doc["rounds"]]
            row += " " + ", ".join("-" if x is None else f"{x:.2f}x" for x in each) + " |"
        lines.append(row)
    if multi:
        lines.append("(splash and vLLM columns: the round with the median throughput ratio)")
    return "\n\n".join(parts + ["\n".join(lines)])


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 5.4), sharex=True, sharey=True)
    for ax, (key, label, color) in zip(axes, (("splash", "splash", "tab:blue"),
                                              ("vllm", "vLLM CPU", "tab:orange"))):
        pts = doc[key].get("itl_timeline") or []
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=5, alpha=0.5, color=color, linewidths=0)
        p99 = doc[key]["p99_itl_ms"]
        ax.axhline(p99, color="k", lw=0.8, ls="--")
        for i, sw in enumerate(doc[key].get("switches") or []):  # live layout switches (splash, T > 1)
            ax.axvline(sw["t_s"], color="tab:red", lw=0.8, alpha=0.7,
                       label="live switch" if i == 0 else None)
        if doc[key].get("switches"):
            ax.legend(loc="upper right", fontsize=8)
        ax.set_title(f"{label}: mean ITL {doc[key]['mean_itl_ms']:.1f} ms, P99 {p99:.1f} ms (dashed)",
                     fontsize=9)
        ax.set_ylabel("inter-token latency, ms")
    axes[-1].set_xlabel("seconds since the first request")
    mix = (f", {doc['long_fraction']:g} of them {doc['long_input_len']} + {doc['output_len']}"
           if doc.get("long_fraction") else "")
    lay = f", {doc['layout']}" if doc.get("layout") else ""
    fig.suptitle(f"{doc['model']} {doc['dtype']}, {doc['tp']} rank(s){lay}: {doc['num_prompts']} x "
                 f"({doc['input_len']} + {doc['output_len']}){mix} at concurrency {doc['max_concurrency']}",
                 fontsize=10)
    save_figure(fig, path)


def run(a: argparse.Namespace) -> int:
    """Measure, report (splash/bench/report.py); exit 1 if any request failed on either server."""
    from splash.bench.report import report

    seen: list[dict[str, Any]] = []
    code = report("serve", a, lambda args: seen.append(measure(args)) or seen[-1], table, plot)
    if code == 0 and any(seen[-1][k]["failed"] for k in ("splash", "vllm")):
        return 1
    return code
