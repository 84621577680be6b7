"""`splash bench offline --kv-compare`: what an FP8 KV cache buys and costs, against the BF16 cache.

Three parts, one table each (JSON and a PNG with --json / --plot):
- decode: for each of --contexts, a batch of random prompts of that length is prefilled, then decoded
  greedily; only the decode steps are timed (`sparse.decode_rate`), once per KV format of --kv-formats
  (the first is the reference: "auto", the model's own dtype, by default). Attention reads the latent
  rows: FP8 reads 656 of 1,152 bytes a token at DeepSeek's dims, dequantising them in the kernel's loop.
- admission: at a fixed --memory-per-rank (default 256MiB), the tokens each rank's pool holds in each
  layout (T = --tp), per format, next to what the analytical core's pool rule (`model_pool_tokens`, what
  `splash plan capacity --model ... --kv-dtype` reports) predicts from the same budget and the engine's
  measured step reserve.
- drift: the cost of FP8 against the reference format, as the logprob drift of greedy tokens: the
  reference engine's greedy continuations of --drift-prompts stdlib prompts are scored teacher-forced by
  every format's engine (prompt logprobs), so each position compares the same token; plus how many
  free-running greedy tokens agree before the first difference.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from splash.bench.report import save_figure
from splash.core.layouts import LAYOUT_NAMES
from splash.model.gemm import cpu_isa


def with_args(args: argparse.Namespace, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **kw})


def ratios(row: dict[str, Any], formats: list[str], key: str) -> dict[str, float]:
    """Each later format's `key` over the reference's (the first format's); {} when that is 0."""
    base = row[formats[0]][key]
    return {f: row[f][key] / base for f in formats[1:]} if base else {}


def decode_rows(path: str, args: argparse.Namespace, formats: list[str]) -> list[dict[str, Any]]:
    from splash.bench.sparse import decode_rate

    rows = []
    for c in [int(x) for x in str(args.contexts).split(",") if x.strip()]:
        row: dict[str, Any] = {"context": c}
        for fmt in formats:
            row[fmt] = decode_rate(path, with_args(args, kv_cache_dtype=fmt), c)
        row["ratio"] = ratios(row, formats, "decode_tokens_per_s")
        rows.append(row)
    return rows


def admission_rows(path: str, args: argparse.Namespace, formats: list[str]) -> list[dict[str, Any]]:
    """Tokens per rank each layout's pool holds at --memory-per-rank, per format, and the core's count."""
    from splash.config import EngineConfig
    from splash.core.capacity import model_pool_tokens
    from splash.core.layouts import Layout
    from splash.core.model_config import ModelConfig, dtype_name
    from splash.core.sizes import AttentionSizes, parse_bytes
    from splash.engine.build import build_engine

    world = args.tp or 1
    budget = args.memory_per_rank or "256MiB"
    cfg = ModelConfig.from_hf(path)
    out = []
    for lay in (LAYOUT_NAMES if world > 1 else ("tp",)):
        row: dict[str, Any] = {"layout": lay if world > 1 else "one rank"}
        for fmt in formats:
            config = EngineConfig.from_cli_args(args, model=path, layout=lay, memory_per_rank=budget,
                                                num_kv_pages=None, kv_cache_dtype=fmt)
            eng = build_engine(config)
            try:
                st = eng.stats()
                held = min(st["kv_pool_tokens_per_rank"])
                reserve = float(eng.info.get("kv_reserve_bytes", 0))
                sizes = AttentionSizes(cfg, dtype_name(st["dtype"]), st["kv_dtype"])
                core = model_pool_tokens(Layout.named(lay), sizes, parse_bytes(budget), world, reserve)
                row[fmt] = {"tokens_per_rank": held, "core_tokens_per_rank": core,
                            "kv_bytes_per_token": sum(st["kv_bytes_per_token"].values())}
            finally:
                eng.shutdown()
        row["ratio"] = ratios(row, formats, "tokens_per_rank")
        out.append(row)
    return out


def drift(path: str, args: argparse.Namespace, formats: list[str]) -> dict[str, Any]:
    """Logprob drift of the reference format's greedy tokens under each other format (teacher-forced)."""
    from splash.bench.speculative import stdlib_prompts
    from splash.config import EngineConfig
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    n, new = args.drift_prompts, args.output_len
    results: dict[str, Any] = {}
    greedy: dict[str, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for fmt in formats:
        config = EngineConfig.from_cli_args(args, model=path, kv_cache_dtype=fmt, num_kv_pages=None,
                                            max_num_seqs=max(n, 1))
        llm = LLM(config=config)
        try:
            if not prompts:
                prompts = stdlib_prompts(llm.get_tokenizer(), n, args.input_len, args.seed)
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            gen = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            greedy[fmt] = [list(o.outputs[0].token_ids) for o in gen]
            base = greedy[formats[0]]
            full = [p + t for p, t in zip(prompts, base)]
            scored = llm.generate(prompt_token_ids=full, sampling_params=SamplingParams(
                temperature=0.0, max_tokens=1, prompt_logprobs=0))
            results[fmt] = [[_logprob(lp, tok) for lp, tok in zip(o.prompt_logprobs[len(p):], t)]
                            for o, p, t in zip(scored, prompts, base)]
        finally:
            llm.shutdown()
    ref = results[formats[0]]
    rows = {}
    for fmt in formats[1:]:
        d = [abs(a - b) for ra, rb in zip(ref, results[fmt]) for a, b in zip(ra, rb)]
        agree = [_agree(a, b) for a, b in zip(greedy[formats[0]], greedy[fmt])]
        rows[fmt] = {"mean_abs_logprob_drift": sum(d) / len(d), "max_abs_logprob_drift": max(d),
                     "p99_abs_logprob_drift": sorted(d)[min(len(d) - 1, int(0.99 * len(d)))],
                     "greedy_tokens_agreeing": sum(agree) / (len(agree) * new),
                     "identical_continuations": sum(a == new for a in agree) / len(agree)}
    return {"prompts": n, "tokens": new, "reference": formats[0], "rows": rows,
            "mean_logprob_reference": sum(sum(r) for r in ref) / sum(len(r) for r in ref)}


def _logprob(entry: Any, tok: int) -> float:
    """The logprob of `tok` in one prompt_logprobs position ({token: Logprob} or {token: float})."""
    v = entry[tok]
    return float(getattr(v, "logprob", v))


def _agree(a: list[int], b: list[int]) -> int:
    """Greedy tokens that agree before the first difference."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from splash.core.model_config import ModelConfig
    from splash.model import resolve_model_path

    path = resolve_model_path(args.model or "small")
    cfg = ModelConfig.from_hf(path)
    formats = [f.strip() for f in str(args.kv_formats).split(",") if f.strip()]
    if len(formats) < 2:
        raise ValueError("--kv-formats needs the reference format and at least one more, e.g. auto,fp8")
    t0 = time.perf_counter()
    doc: dict[str, Any] = {"model": args.model or "small", "dtype": args.dtype or "bfloat16",
                           "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                           "batch": args.batch, "decode_tokens": args.output_len, "formats": formats,
                           "threads": torch.get_num_threads(), "isa": cpu_isa(), "ranks": args.tp or 1,
                           "memory_per_rank": args.memory_per_rank or "256MiB"}
    if args.kv_parts in ("all", "decode"):
        doc["decode"] = decode_rows(path, args, formats)
    if args.kv_parts in ("all", "admission"):
        doc["admission"] = admission_rows(path, args, formats)
    if args.kv_parts in ("all", "drift"):
        doc["drift"] = drift(path, args, formats)
    doc["seconds"] = time.perf_counter() - t0
    return doc


def table(doc: dict[str, Any]) -> str:
    fmts = doc["formats"]
    names = [f + "/" + fmts[0] for f in fmts[1:]]
    w = max(18, *(len(n) + 2 for n in names))  # (a column wide enough for its name)
    ratio_head = "".join(f"{n:>{w}}" for n in names)

    def ratio_cells(r: dict[str, Any], digits: int) -> str:
        return "".join(f"{r['ratio'].get(f, math.nan):>{w - 1}.{digits}f}x" for f in fmts[1:])

    lines = [f"KV formats: {doc['model']} ({doc['dtype']} weights, latent {doc['kv_lora_rank']} + rope "
             f"{doc['qk_rope_head_dim']}), {doc['threads']} threads, CPU {doc['isa']}"]
    if "decode" in doc:
        lines.append(f"decode tok/s, batch {doc['batch']}, {doc['decode_tokens']} steps (auto: the model's "
                     "dtype)")
        lines.append(f"{'context':>8}" + "".join(f"{f:>13}" for f in fmts) + ratio_head)
        for r in doc["decode"]:
            lines.append(f"{r['context']:>8}" + "".join(f"{r[f]['decode_tokens_per_s']:>13.2f}" for f in fmts)
                         + ratio_cells(r, 2))
    if "admission" in doc:
        lines.append(f"admission at --memory-per-rank {doc['memory_per_rank']}, T={doc['ranks']}: tokens per "
                     "rank (runtime / core's pool rule)")
        lines.append(f"{'layout':>9}" + "".join(f"{f:>22}" for f in fmts) + ratio_head)
        for r in doc["admission"]:
            cells = "".join(f"{r[f]['tokens_per_rank']:>12,} / {r[f]['core_tokens_per_rank']:<7,}"
                            for f in fmts)
            lines.append(f"{r['layout']:>9}" + cells + ratio_cells(r, 3))
    if "drift" in doc:
        d = doc["drift"]
        lines.append(f"drift against the {d['reference']} cache: {d['prompts']} stdlib prompts x "
                     f"{d['tokens']} greedy tokens, teacher-forced (mean reference logprob "
                     f"{d['mean_logprob_reference']:.3f})")
        lines.append(f"{'format':>12}{'mean |dlp|':>12}{'p99 |dlp|':>11}{'max |dlp|':>11}"
                     f"{'greedy agree':>14}{'same text':>11}")
        for f, r in d["rows"].items():
            lines.append(f"{f:>12}{r['mean_abs_logprob_drift']:>12.5f}{r['p99_abs_logprob_drift']:>11.4f}"
                         f"{r['max_abs_logprob_drift']:>11.4f}{r['greedy_tokens_agreeing']:>13.1%}"
                         f"{r['identical_continuations']:>10.0%}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("decode", "admission") if p in doc]
    fig, axes = plt.subplots(1, max(1, len(parts)), figsize=(6 * max(1, len(parts)), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "decode":
            xs = [r["context"] for r in doc["decode"]]
            for f in doc["formats"]:
                ax.plot(xs, [r[f]["decode_tokens_per_s"] for r in doc["decode"]], "o-", label=f)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"decode, batch {doc['batch']} ({doc['isa']})")
        else:
            rows = doc["admission"]
            w = 0.8 / len(doc["formats"])
            for k, f in enumerate(doc["formats"]):
                ax.bar([i + k * w for i in range(len(rows))], [r[f]["tokens_per_rank"] for r in rows], w,
                       label=f)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rows))], [r["layout"] for r in rows])
            ax.set_ylabel("KV tokens per rank")
            ax.set_title(f"admission at {doc['memory_per_rank']} per rank, T={doc['ranks']}")
        ax.legend()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from splash.bench.report import report

    return report("offline", args, measure, table, plot)
