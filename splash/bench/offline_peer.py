"""`splash bench offline --peer vllm`: splash and vLLM's CPU engine side by side on the same prompts.

Per batch shape (batch x prompt tokens x new tokens; default 1x32x64, 16x32x64, 64x128x128) both engines
get the same random token-id prompts, greedy, `ignore_eos`, one warm-up call of the same batch, then
--repeat timed calls (the fastest counts). One engine at a time: splash first (each layout in turn, on
T > 1 TP and DOP unless --layout names one), then vLLM in its own venv (`make peer-venv`) through
`vllm_driver.py`, its start-up and compile excluded. Reported per shape: output tok/s of each, the ratio,
and how far the greedy tokens agree (bf16 on different kernels drifts apart after a while; the first
tokens should agree).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from splash.bench.report import save_figure

DEFAULT_SHAPES = "1x32x64,16x32x64,64x128x128"
Shape = tuple[int, int, int]  # batch, input_len, output_len


def shapes_arg(text: str) -> list[Shape]:
    """argparse type: 'BxIxO,...' -> [(B, I, O), ...], each a positive integer."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        bits = part.lower().split("x")
        try:
            shape = tuple(int(b) for b in bits)
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) < 1:
            raise argparse.ArgumentTypeError(
                f"a shape is BATCHxPROMPTxNEW with positive integers (e.g. 16x32x64), got {part!r}")
        out.append(shape)
    return out  # type: ignore[return-value]


def add_peer_args(p: argparse.ArgumentParser) -> None:
    from splash.argtypes import output_file, positive_float, positive_int
    from splash.bench.peer import PEERS

    p.add_argument("--peer", choices=PEERS, default=None,
                   help="also run the same prompts through this peer engine (vllm: vLLM's CPU engine from "
                        "`make peer-venv`) and print both, per batch shape; implies --dtype bfloat16")
    p.add_argument("--shapes", type=shapes_arg, default=None, metavar="BxIxO,...",
                   help=f"with --peer: batch x prompt x new-token shapes (default {DEFAULT_SHAPES})")
    p.add_argument("--peer-kv-gib", type=positive_float, default=2.0,
                   help="with --peer: the peer's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, default 2)")
    p.add_argument("--peer-timeout", type=positive_int, default=3600,
                   help="with --peer: seconds the peer's run may take (a first start compiles ~100 s)")
    p.add_argument("--plot", default=None, metavar="FILE", type=output_file,
                   help="with --peer: write a bar chart of tok/s per shape (PNG); with --sparse-vs-dense: "
                        "tok/s by context; with --json-schema: tok/s per batch")


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations the side-by-side cannot honour, with the fix, before anything loads."""
    from splash.core.model_config import ConfigError, normalize_dtype

    if args.peer is None:
        for flag, v in (("--shapes", args.shapes), ("--plot", args.plot)):
            if v is not None:
                raise ConfigError(f"{flag} goes with --peer vllm")
        return
    if args.compare_hf:
        raise ConfigError("--compare-hf and --peer: one comparison per run, choose one")
    if args.dtype is not None and normalize_dtype(args.dtype) != "bf16":
        raise ConfigError("--peer vllm compares in bfloat16 (vLLM's CPU MLA kernel takes bf16 only); "
                          "drop --dtype or pass --dtype bfloat16")
    if (args.nnodes or 1) != 1:
        raise ConfigError("--peer runs both engines on this machine; drop --nnodes")
    if args.layout == "auto" or args.switch_schedule:
        raise ConfigError("--peer compares fixed layouts; pass --layout tp|dp|cp|dop or none")


def layouts_for(args: argparse.Namespace) -> list[str | None]:
    tp = args.tp or 1
    if args.layout:
        return [args.layout]
    return ["tp", "dop"] if tp > 1 else [None]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from splash.bench.workload import random_prompts
    from splash.core.model_config import ModelConfig
    from splash.model import resolve_model_path

    check_args(args)
    from splash.bench.peer import peer_python

    py = peer_python()  # fail before splash loads anything
    shapes = args.shapes or shapes_arg(DEFAULT_SHAPES)
    path = resolve_model_path(args.model or "tiny")
    vocab = ModelConfig.from_hf(path).vocab_size
    prompts = [random_prompts(b, i, vocab, args.seed + k) for k, (b, i, _o) in enumerate(shapes)]
    splash: dict[str, list[dict[str, Any]]] = {}
    for layout in layouts_for(args):
        name, runs = run_splash(args, layout, shapes, prompts)
        splash[name] = runs
    peer = run_vllm(py, path, shapes, prompts, tp=args.tp or 1, repeat=args.repeat, kv_gib=args.peer_kv_gib,
                    timeout=args.peer_timeout)
    return build_doc(args, shapes, splash, peer)


def run_splash(args: argparse.Namespace, layout: str | None, shapes: list[Shape],
               prompts: list[list[list[int]]]) -> tuple[str, list[dict[str, Any]]]:
    """One splash engine (one layout) over every shape: seconds (fastest of --repeat) and tokens."""
    from splash.config import EngineConfig
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    biggest = max(b for b, _, _ in shapes)
    config = EngineConfig.from_cli_args(args, dtype="bfloat16", layout=layout,
                                        max_num_seqs=max(args.max_num_seqs or 64, biggest))
    runs = []
    with LLM(config=config) as llm:
        name = str(llm.stats().get("layout") or layout or "tp")
        for (_b, _i, out_len), ps in zip(shapes, prompts):
            llm.generate(prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0.0, max_tokens=2,
                                                                             ignore_eos=True))
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            best, outs = float("inf"), []
            for _ in range(args.repeat):
                llm.reset_prefix_cache()  # time prefill, not the warm-up's cached pages
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
                best = min(best, time.perf_counter() - t0)
            runs.append({"seconds": best, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    return name, runs


def run_vllm(py: str, path: str, shapes: list[Shape], prompts: list[list[list[int]]], *, tp: int, repeat: int,
             kv_gib: float, timeout: float) -> dict[str, Any]:
    """vLLM's CPU engine over every shape, in the peer venv (`vllm_driver.py`); its process group is
    stopped by id whatever happens."""
    from splash.bench.peer import PeerProcess, peer_env

    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_driver.py")
    with tempfile.TemporaryDirectory(prefix="splash-peer-") as tmp:
        job, out = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job, "w", encoding="utf-8") as f:
            work = [{"prompts": ps, "output_len": o} for (_b, _i, o), ps in zip(shapes, prompts)]
            json.dump({"model": path, "dtype": "bfloat16", "tp": tp, "repeat": repeat, "shapes": work}, f)
        with PeerProcess([py, driver, job, out], env=peer_env(tp, kv_gib, python=py), name="vLLM") as proc:
            rc = proc.wait(timeout)
            if rc != 0 or not os.path.isfile(out):
                raise RuntimeError(proc.failure())
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """first_token: share of sequences whose first generated token agrees; prefix: mean share of each
    sequence generated identically before the first divergence."""
    from splash.bench.workload import greedy_agreement

    first = [bool(x) and bool(y) and x[0] == y[0] for x, y in zip(a, b)]
    return {"first_token": sum(first) / max(1, len(first)), "prefix": greedy_agreement(a, b)}


def build_doc(args: argparse.Namespace, shapes: list[Shape], splash: dict[str, list[dict[str, Any]]],
              peer: dict[str, Any]) -> dict[str, Any]:
    """The JSON result: one row per shape with each side's throughput, the ratios and the agreement."""
    rows = []
    for k, (b, i, o) in enumerate(shapes):
        theirs = peer["shapes"][k]
        v_rate = b * o / theirs["seconds"]
        row: dict[str, Any] = {"batch": b, "input_len": i, "output_len": o, "splash": {}, "ratio": {},
                               "agreement": {},
                               "vllm": {"seconds": theirs["seconds"], "output_tokens_per_s": v_rate}}
        for layout, runs in splash.items():
            mine = runs[k]
            rate = b * o / mine["seconds"]
            row["splash"][layout] = {"seconds": mine["seconds"], "output_tokens_per_s": rate}
            row["ratio"][layout] = rate / v_rate
            row["agreement"][layout] = agreement(mine["tokens"], theirs["tokens"])
        rows.append(row)
    return {"model": args.model or "tiny", "dtype": "bfloat16", "tp": args.tp or 1, "repeat": args.repeat,
            "seed": args.seed, "threads": _threads(), "peer": "vllm", "peer_version": peer.get("version"),
            "peer_load_seconds": peer.get("load_seconds"), "layouts": list(splash), "rows": rows}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def table(doc: dict[str, Any]) -> str:
    lays = doc["layouts"]
    tag = (lambda lay: f"splash {lay}") if len(lays) > 1 or doc["tp"] > 1 else (lambda lay: "splash")
    head = (f"offline, splash vs vLLM {doc.get('peer_version') or ''} CPU: {doc['model']} {doc['dtype']}, "
            f"{doc['tp']} rank(s), fastest of {doc['repeat']}; output tok/s, greedy, ignore_eos")
    cols = ["batch x prompt x new"] + [f"{tag(lay)} tok/s" for lay in lays] + ["vLLM tok/s"]
    cols += [f"{tag(lay)} / vLLM" for lay in lays] + [f"first tokens agree ({lay})" if len(lays) > 1
                                                       else "first tokens agree" for lay in lays]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["rows"]:
        cells = [f"{r['batch']} x {r['input_len']} x {r['output_len']}"]
        cells += [f"{r['splash'][lay]['output_tokens_per_s']:.0f}" for lay in lays]
        cells += [f"{r['vllm']['output_tokens_per_s']:.0f}"]
        cells += [f"{r['ratio'][lay]:.2f}x" for lay in lays]
        for lay in lays:
            a = r["agreement"][lay]
            n = r["batch"]
            cells.append(f"{round(a['first_token'] * n)}/{n} (prefix {a['prefix']:.0%})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, lays = doc["rows"], doc["layouts"]
    tag = (lambda lay: f"splash {lay}") if len(lays) > 1 or doc["tp"] > 1 else (lambda lay: "splash")
    series = [(tag(lay), [r["splash"][lay]["output_tokens_per_s"] for r in rows]) for lay in lays]
    peer = f"vLLM {doc.get('peer_version') or ''} CPU"
    series.append((peer, [r["vllm"]["output_tokens_per_s"] for r in rows]))
    fig, ax = plt.subplots(figsize=(1.6 + 1.8 * len(rows), 3.6))
    width = 0.8 / len(series)
    for k, (label, ys) in enumerate(series):
        xs = [j + (k - (len(series) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['batch']}x{r['input_len']}x{r['output_len']}" for r in rows])
    ax.set_xlabel("batch x prompt x new tokens")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{doc['model']} {doc['dtype']}, {doc['tp']} rank(s)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from splash.bench.report import report

    return report("offline", args, measure, table, plot)
