"""`splash bench offline --sparse-vs-dense`: a DSA model's decode speed against itself made dense.

For each context c (default 1k, 4k, 16k) a batch of random prompts of c tokens is prefilled, then
decoded greedily; only the decode steps are timed (the prefill is what it is: the same in spirit for
both, and not the question). "Dense" is the same checkpoint with `index_topk` raised past every
context (a copy of the folder whose config.json says so, the weights linked), so every query reads
every key: exactly what the model computes when top-k covers the context. Sparse decode reads at
most `index_topk` keys per query in the main attention and scores every key in the indexer, so its
lead grows with the context once c passes top-k.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from splash.bench.report import save_figure
from splash.model.gemm import cpu_isa


def dense_copy(path: str, out_dir: str) -> str:
    """`path`'s checkpoint with index_topk past any context: config.json rewritten, weights linked."""
    dst = os.path.join(out_dir, os.path.basename(os.path.normpath(path)) + "-dense")
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(path):
        src, tgt = os.path.join(path, f), os.path.join(dst, f)
        if f != "config.json" and not os.path.exists(tgt):
            os.symlink(os.path.abspath(src), tgt)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["index_topk"] = 1 << 30
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return dst


def decode_rate(path: str, args: argparse.Namespace, context: int) -> dict[str, float]:
    """Prefill `args.batch` random prompts of `context` tokens, then time `args.output_len` decode steps."""
    from splash.bench.workload import random_prompts
    from splash.config import EngineConfig
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    page = args.page_size or 16
    config = EngineConfig.from_cli_args(
        args, model=path, max_num_seqs=max(args.batch, 1), max_model_len=context + args.output_len + 1,
        num_kv_pages=args.batch * (-(-(context + args.output_len + 1) // page)) + 4, memory_per_rank=None)
    llm = LLM(config=config)
    eng = llm.llm_engine
    try:
        prompts = random_prompts(args.batch, context, eng.vocab_size or 256, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), prompt_token_ids=p, params=params)
        t0 = time.perf_counter()
        sched = eng.scheduler
        while eng.has_unfinished() and (sched.waiting or any(not s.output_token_ids for s in sched.running)):
            eng.step()  # until every request is prefilled and has its first token
        t1, steps = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        t2 = time.perf_counter()
    finally:
        llm.shutdown()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
            "decode_tokens_per_s": args.batch * steps / (t2 - t1) if steps else 0.0}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from splash.core.model_config import SPARSE_MODEL_TYPES, ModelConfig
    from splash.model import resolve_model_path

    path = resolve_model_path(args.model or "tiny")
    cfg = ModelConfig.from_hf(path)
    if cfg.model_type not in SPARSE_MODEL_TYPES:
        raise ValueError(f"--sparse-vs-dense needs a DSA model (DeepSeek-V3.2 / GLM-5 shape), "
                         f"{args.model or 'tiny'!r} is {cfg.model_type}; try --model small-dsa")
    contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="splash-dense-") as tmp:
        dense = dense_copy(path, tmp)
        for c in contexts:
            s = decode_rate(path, args, c)
            d = decode_rate(dense, args, c)
            rows.append({"context": c, "sparse": s, "dense": d,
                         "ratio": s["decode_tokens_per_s"] / d["decode_tokens_per_s"]})
    import torch

    return {"model": args.model or "tiny", "index_topk": cfg.index_topk, "index_heads": cfg.index_n_heads,
            "index_head_dim": cfg.index_head_dim, "batch": args.batch, "decode_tokens": args.output_len,
            "dtype": args.dtype or "float32", "threads": torch.get_num_threads(), "isa": cpu_isa(),
            "rows": rows}


def table(doc: dict[str, Any]) -> str:
    lines = [f"sparse vs dense decode: {doc['model']} (top-k {doc['index_topk']}, indexer "
             f"{doc['index_heads']}x{doc['index_head_dim']}), batch {doc['batch']}, {doc['decode_tokens']} "
             f"decode steps, {doc['dtype']}, {doc['threads']} threads, CPU {doc['isa']}",
             f"{'context':>8}{'sparse tok/s':>14}{'dense tok/s':>13}{'sparse/dense':>14}"
             f"{'prefill s (sp/de)':>20}"]
    for r in doc["rows"]:
        s, d = r["sparse"], r["dense"]
        lines.append(f"{r['context']:>8}{s['decode_tokens_per_s']:>14.2f}{d['decode_tokens_per_s']:>13.2f}"
                     f"{r['ratio']:>13.2f}x{s['prefill_s']:>11.1f} / {d['prefill_s']:.1f}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["context"] for r in doc["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["sparse"]["decode_tokens_per_s"] for r in doc["rows"]], "o-", label="sparse (DSA)")
    ax.plot(xs, [r["dense"]["decode_tokens_per_s"] for r in doc["rows"]], "s--",
            label="dense (top-k >= context)")
    ax.axvline(doc["index_topk"], color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{doc['model']}: decode, batch {doc['batch']} ({doc['isa']})")
    ax.legend()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from splash.bench.report import report

    return report("offline", args, measure, table, plot)
