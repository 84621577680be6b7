"""`splash bench offline --speculative-algorithm MTP|NGRAM --speculative-compare`: what speculation buys.

At each of --batches, the same greedy batch (`ignore_eos`, --output-len tokens each) without speculation,
with the depth policy (`--speculative-policy auto`) and always at full depth: output tok/s over the
whole generate (prefill included, the same in every mode), the ratio to no speculation, tokens per
verify (SGLang's accept length) and the depth the policy ran at on average. Each mode is its own engine,
all three built up front (each with its batch's KV pages) and run in turn, off / auto / always, --repeat
times per batch; the fastest run of each counts (this VM's speed drifts by 10-30% over a minute, which
mode after mode put into the ratios). `--prompts stdlib` takes real text (windows of the Python standard
library's sources, the trained MTP model's own kind of text; `splash model train-mtp`) where random
tokens would be accepted by nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from splash.bench.report import save_figure

MODES = ("off", "auto", "always")


def stdlib_prompts(tokenizer: Any, batch: int, input_len: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `input_len` tokens: windows of the standard library's sources, picked by seed
    from files in sorted order (the same on every machine with the same Python)."""
    import os
    import random
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < batch:
        try:
            with open(rng.choice(files), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 8 * input_len:
            continue
        at = rng.randrange(0, len(text) - 8 * input_len)
        ids = tokenizer.encode(text[at:at + 8 * input_len], add_special_tokens=False)
        if len(ids) >= input_len:
            out.append(list(ids[:input_len]))
    return out


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    eng = llm.llm_engine
    depths: list[int] = []

    def hook(_info: dict[str, Any]) -> None:
        depths.append(eng.depth.k if eng.depth is not None else (eng.config.num_drafts
                                                                 if eng.scheduler.proposer else 0))

    v0, d0, a0 = eng.spec_verify_ct, eng.spec_drafts, eng.spec_accepted
    eng.on_step.append(hook)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        dt = time.perf_counter() - t0
    finally:
        eng.on_step.remove(hook)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    verify, accepted = eng.spec_verify_ct - v0, eng.spec_accepted - a0
    return {"seconds": dt, "tok_per_s": tokens / dt, "tokens": tokens,
            "accept_length": 1 + accepted / verify if verify else None, "verify": verify,
            "drafts": eng.spec_drafts - d0, "accepted": accepted,
            "mean_depth": sum(depths) / len(depths) if depths else 0.0,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from splash.bench.workload import random_prompts
    from splash.config import EngineConfig
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    try:
        batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError("--batches takes positive batch sizes, e.g. 1,4,16,64")
        if not args.speculative_algorithm:
            raise ValueError("--speculative-compare needs --speculative-algorithm MTP or NGRAM")
        base = EngineConfig.from_cli_args(args, max_num_seqs=max(max(batches), args.max_num_seqs or 0))
    except (ValueError, FileNotFoundError) as e:
        print(f"splash bench offline: error: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if base.num_kv_pages is None:  # three engines live at once: each its batch's pages, not the machine's
        per_seq = -(-(args.input_len + args.output_len + base.num_drafts + 1) // base.page_size)
        base = dataclasses.replace(base, num_kv_pages=2 * per_seq * max(batches) + 16)
    rows: dict[int, dict[str, Any]] = {b: {"batch": b} for b in batches}
    info: dict[str, Any] = {}
    prompts: list[list[int]] = []
    llms: dict[str, Any] = {}
    try:
        for mode in MODES:
            cfg = (dataclasses.replace(base, speculative_algorithm=None, speculative_num_steps=None,
                                       speculative_num_draft_tokens=None, speculative_config=None)
                   if mode == "off" else dataclasses.replace(base, speculative_policy=mode))
            llm = llms[mode] = LLM(config=cfg)
            eng = llm.llm_engine
            if not prompts:
                n, vocab = max(batches), eng.vocab_size or 256
                if args.prompts == "stdlib":
                    prompts = stdlib_prompts(llm.get_tokenizer(), n, args.input_len, args.seed)
                else:
                    prompts = random_prompts(n, args.input_len, vocab, args.seed)
                info = {k: eng.stats().get(k) for k in ("model", "dtype", "device", "ranks")}
            warm = dataclasses.replace(params, max_tokens=8)
            llm.generate(prompt_token_ids=prompts[:2], sampling_params=warm, use_tqdm=False)  # warm-up
        for b in batches:  # the modes take turns, so that a machine slowing down mid-run hits them alike
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for _ in range(args.repeat):
                for mode in MODES:
                    llms[mode].reset_prefix_cache()
                    runs[mode].append(_generate(llms[mode], prompts[:b], params))
            for mode in MODES:
                rows[b][mode] = max(runs[mode], key=lambda r: r["tok_per_s"])
    finally:
        for llm in llms.values():
            llm.shutdown()
    for row in rows.values():
        off = row["off"]["tok_per_s"]
        for mode in ("auto", "always"):
            row[mode]["vs_off"] = row[mode]["tok_per_s"] / off if off else None
            row[mode]["same_tokens"] = row[mode].pop("token_ids") == row["off"]["token_ids"]
        row["off"].pop("token_ids")
    doc = {"engine": info, "algorithm": base.speculative_algorithm, "num_drafts": base.num_drafts,
           "input_len": args.input_len, "output_len": args.output_len, "prompts": args.prompts,
           "repeat": args.repeat, "rows": list(rows.values())}
    if args.plot:
        plot(doc, args.plot)
        doc["plot"] = args.plot
    if args.json:
        print(json.dumps(doc))
        return 0
    print(table(doc))
    return 0


def table(doc: dict[str, Any]) -> str:
    e = doc["engine"]
    lines = [f"speculative decoding ({doc['algorithm']}, up to {doc['num_drafts']} drafts): {e.get('model')} "
             f"{e.get('dtype')} on {e.get('device')}, {doc['prompts']} prompts of {doc['input_len']} tokens, "
             f"{doc['output_len']} generated each (greedy), best of {doc['repeat']}",
             f"{'batch':>5} {'off tok/s':>9} {'auto tok/s':>10} {'x':>5} {'depth':>5} {'always tok/s':>12} "
             f"{'x':>5} {'accept len':>10} {'same tokens':>11}"]
    for r in doc["rows"]:
        a, w = r["auto"], r["always"]
        acc = w["accept_length"]
        lines.append(f"{r['batch']:>5} {r['off']['tok_per_s']:>9.1f} {a['tok_per_s']:>10.1f} "
                     f"{a['vs_off']:>5.2f} {a['mean_depth']:>5.1f} {w['tok_per_s']:>12.1f} "
                     f"{w['vs_off']:>5.2f} {'-' if acc is None else format(acc, '.2f'):>10} "
                     f"{'yes' if a['same_tokens'] and w['same_tokens'] else 'NO':>11}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = doc["rows"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, mode in enumerate(MODES):
        ax.bar(x + (k - 1) * 0.27, [r[mode]["tok_per_s"] for r in rows], 0.27, label=mode)
    ax.set_xticks(x, [str(r["batch"]) for r in rows])
    ax.set_xlabel("batch")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"speculative decoding ({doc['algorithm']}): off / depth policy / always")
    ax.legend()
    save_figure(fig, path)
