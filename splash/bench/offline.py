"""`splash bench offline`: generation throughput of the Python API on a fixed batch.

A batch of random-token prompts (fixed input length, seeded) is generated greedily to exactly
--output-len tokens (`ignore_eos`). With --compare-hf, transformers' `generate` runs the same
checkpoint, dtype, batch and greedy decoding in the same process, and the ratio is reported.
Both sides get one short warm-up run, then --repeat timed runs; the fastest of each side counts.
The prefix cache is flushed before each timed run: the same prompts again would be cached prefills.
With --peer vllm, vLLM's CPU engine runs the same prompts instead, per batch shape (bench/offline_peer.py).
With --json-schema, constrained against unconstrained decoding (bench/structured.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from splash.bench.workload import greedy_agreement, random_prompts


def register(kinds: argparse._SubParsersAction) -> None:
    from splash.argtypes import positive_int
    from splash.config import EngineConfig

    p = kinds.add_parser("offline", help="offline generation throughput (optionally vs transformers)",
                         description="Time LLM.generate on a fixed batch of random-token prompts.")
    EngineConfig.add_cli_args(p)  # every engine option (splash/config.py)
    p.add_argument("--batch", type=positive_int, default=16, help="prompts in the batch")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens each")
    p.add_argument("--output-len", type=positive_int, default=128, help="generated tokens each")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="timed runs per side; the fastest counts (default 3: robust to a busy machine)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also time transformers' generate on the same checkpoint and batch")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sparse-vs-dense", action="store_true",
                   help="DSA models: decode tok/s at each of --contexts against the same model with "
                        "index_topk >= the context (dense); use --batch 1 and a small --output-len")
    p.add_argument("--contexts", default="1024,4096,16384", metavar="N,N",
                   help="prompt lengths for --sparse-vs-dense and --kv-compare (default 1024,4096,16384)")
    p.add_argument("--kv-compare", action="store_true",
                   help="the FP8 KV cache formats against the model's dtype: decode tok/s at each of "
                        "--contexts, tokens each layout admits at --memory-per-rank (default 256MiB; T from "
                        "--tp) next to the core's pool rule, and the logprob drift of greedy tokens")
    p.add_argument("--kv-formats", default="auto,fp8_ds_mla,fp8_e4m3", metavar="F,F",
                   help="--kv-compare: KV formats, the first the reference (default "
                        "auto,fp8_ds_mla,fp8_e4m3; under a float32 model bfloat16,fp8_ds_mla,fp8_e4m3 "
                        "compares storage alone)")
    p.add_argument("--kv-parts", default="all", choices=("all", "decode", "admission", "drift"),
                   help="--kv-compare: which parts to run (default all)")
    p.add_argument("--drift-prompts", type=positive_int, default=16,
                   help="--kv-compare: stdlib prompts (of --input-len tokens) the drift is measured on")
    p.add_argument("--json-schema", default=None, metavar="FILE|builtin",
                   help="decode tok/s constrained by this JSON schema against unconstrained, at each of "
                        "--batches, with the grammar's time per step (builtin: an agent-style schema)")
    p.add_argument("--batches", default="1,16,64", metavar="B,B",
                   help="batch sizes for --json-schema and --speculative-compare (default 1,16,64)")
    p.add_argument("--speculative-compare", action="store_true",
                   help="with --speculative-algorithm: output tok/s at each of --batches without "
                        "speculation, with the depth policy and always at full depth")
    p.add_argument("--prompts", default="random", choices=("random", "stdlib"),
                   help="--speculative-compare's prompts: random tokens, or windows of the Python standard "
                        "library's sources (real text, what `splash model train-mtp` learns)")
    p.add_argument("--prefix-compare", action="store_true",
                   help="the prefix cache off vs on: GRPO groups (--batch prompts x --n samples) and, with "
                        "--turns, agent turns resending their history; prompt tokens computed and tok/s")
    p.add_argument("--n", type=positive_int, default=8, help="--prefix-compare: samples per prompt")
    p.add_argument("--turns", type=int, default=0, help="--prefix-compare: agent turns (0: none)")
    p.add_argument("--turn-len", type=positive_int, default=32,
                   help="--prefix-compare: new tokens a turn adds to the history")
    from splash.bench.offline_peer import add_peer_args

    add_peer_args(p)
    p.set_defaults(func=run)


def _rates(batch: int, input_len: int, output_len: int, seconds: float) -> dict[str, float]:
    return {"seconds": seconds, "output_tokens_per_s": batch * output_len / seconds,
            "total_tokens_per_s": batch * (input_len + output_len) / seconds,
            "requests_per_s": batch / seconds}


def run_splash(args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]], list[list[int]], Any]:
    from splash.config import EngineConfig
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    llm = LLM(config=EngineConfig.from_cli_args(args, max_num_seqs=max(args.max_num_seqs or 64, args.batch)))
    eng = llm.llm_engine
    prompts = random_prompts(args.batch, args.input_len, eng.vocab_size or 256, args.seed)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=warm)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    dt = float("inf")
    for _ in range(args.repeat):
        llm.reset_prefix_cache()  # every timed run prefills its prompts (the warm-up's pages are cached)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        dt = min(dt, time.perf_counter() - t0)
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.stats()
    res = _rates(args.batch, args.input_len, args.output_len, dt)
    res.update(engine={k: stats[k] for k in ("model", "dtype", "device", "layout", "ranks", "kv_pool_tokens",
                                             "max_num_batched_tokens", "steps", "decode_plan_bytes_p50",
                                             "speculative_algorithm", "spec_verify_ct", "spec_draft_tokens",
                                             "spec_accepted_tokens", "spec_accept_length") if k in stats})
    return res, prompts, tokens, eng


def run_hf(args: argparse.Namespace, prompts: list[list[int]], dtype_name: str, device: str
           ) -> tuple[dict[str, Any], list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    from splash.model import resolve_dtype, resolve_model_path

    path = resolve_model_path(args.model or "tiny")
    dtype = resolve_dtype(dtype_name, device)
    kw: dict[str, Any] = {"dtype": dtype}
    if dtype == torch.float64:
        kw["experts_implementation"] = "eager"  # transformers' fused MoE kernels lack float64 on CPU
    model = AutoModelForCausalLM.from_pretrained(path, **kw).to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def gen(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=pad, eos_token_id=None)

    gen(2)
    dt = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = gen(args.output_len)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = min(dt, time.perf_counter() - t0)
    return _rates(len(prompts), args.input_len, args.output_len, dt), out[:, width:].tolist()


def run(args: argparse.Namespace) -> int:
    import torch

    from splash.bench import offline_peer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peer:
        return offline_peer.run(args)
    if args.sparse_vs_dense:
        from splash.bench import sparse

        return sparse.run(args)
    if args.kv_compare:
        from splash.bench import kvformat

        return kvformat.run(args)
    if args.json_schema:
        from splash.bench import structured

        return structured.run(args)
    if args.speculative_compare:
        from splash.bench import speculative

        return speculative.run(args)
    if args.prefix_compare:
        from splash.bench import prefix

        return prefix.run(args)
    try:
        offline_peer.check_args(args)
        res, prompts, tokens, eng = run_splash(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"splash bench offline: error: {e}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
                           "threads": torch.get_num_threads(), "repeat": args.repeat, "splash": res}
    if args.compare_hf:
        try:
            hf, hf_tokens = run_hf(args, prompts, res["engine"]["dtype"], res["engine"]["device"])
        except ImportError:
            print("splash bench offline: error: --compare-hf needs transformers (pip install transformers)",
                  file=sys.stderr)
            return 2
        doc["hf"] = hf
        doc["speedup"] = res["output_tokens_per_s"] / hf["output_tokens_per_s"]
        doc["greedy_agreement"] = greedy_agreement(tokens, hf_tokens)
    if args.json:
        print(json.dumps(doc))
        return 0
    e = res["engine"]
    print(f"offline: {e.get('model')} {e.get('dtype')} on {e.get('device')}, batch {args.batch}, "
          f"input {args.input_len}, output {args.output_len}, {doc['threads']} threads")
    print(f"{'':12}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}{'req/s':>9}")
    rows = [("splash", res)] + ([("transformers", doc["hf"])] if "hf" in doc else [])
    for name, r in rows:
        print(f"{name:12}{r['seconds']:>10.3f}{r['output_tokens_per_s']:>12.1f}{r['total_tokens_per_s']:>13.1f}"
              f"{r['requests_per_s']:>9.2f}")
    if e.get("spec_verify_ct"):
        print(f"speculative ({e['speculative_algorithm']}): {e['spec_accepted_tokens']} of "
              f"{e['spec_draft_tokens']} drafts accepted over all runs, {e['spec_accept_length']:.2f} "
              f"tokens per verify")
    if "speedup" in doc:
        print(f"splash / transformers output throughput: {doc['speedup']:.2f}x "
              f"(greedy agreement {doc['greedy_agreement']:.0%})")
    return 0
