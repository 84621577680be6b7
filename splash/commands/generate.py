"""`splash generate`: run prompts through the offline engine and print the completions (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from splash.argtypes import positive_int
from splash.config import EngineConfig


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}"
                                         ) from None
    if not ids or any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"--prompt-ids wants non-negative integers, got {text!r}")
    return ids


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every engine option (splash/config.py: one table, SGLang's and vLLM's spellings accepted)."""
    EngineConfig.add_cli_args(p)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The engine's options as the user gave them (ConfigError naming the fix)."""
    return EngineConfig.from_cli_args(args, **overrides)


def follow_as_worker(args: argparse.Namespace) -> bool:
    """On a node without rank 0: serve this node's ranks until rank 0 shuts down (True), else False."""
    from splash.engine.group import follow_if_worker

    return follow_if_worker(engine_config(args))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions offline (no server)",
                       description="Generate completions for prompts with the offline engine.")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", type=_ids, default=[], metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--n", type=positive_int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from splash.distributed.launch import WorkerError
    from splash.engine.sampling import SamplingParams

    try:
        engine_config(args)  # a bad option fails here, before any rank starts
        if follow_as_worker(args):
            return 0  # this node served its ranks; rank 0 (on node 0) prints the results
    except ValueError as e:
        print(f"splash generate: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"splash generate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if not args.prompt and not args.prompt_ids:
        print("splash generate: error: give at least one --prompt TEXT or --prompt-ids 1,2,3",
              file=sys.stderr)
        return 2
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"splash generate: error: {e}", file=sys.stderr)
        return 2
    prompts: list[Any] = [*args.prompt, *({"prompt_token_ids": ids} for ids in args.prompt_ids)]
    from splash.engine.group import GroupFailed
    from splash.llm import LLM

    llm = None
    try:
        llm = LLM(config=engine_config(args))
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"splash generate: error: {e}", file=sys.stderr)
        return 2
    except (WorkerError, GroupFailed, TimeoutError) as e:
        print(f"splash generate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if llm is not None:
            llm.shutdown()
    if args.json:
        rows = [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "index": c.index,
                 "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                 "spec_verify_ct": c.spec_verify_ct}
                for o in outs for c in o.outputs]
        engine = {k: stats[k] for k in ("model", "dtype", "device", "layout", "ranks", "nnodes",
                                         "kv_pool_tokens", "kv_distinct_tokens", "kv_pool_tokens_per_rank",
                                         "max_request_tokens", "weight_bytes_per_rank", "page_size",
                                         "max_model_len",
                                         "max_num_seqs", "max_num_batched_tokens", "prompt_tokens_total",
                                         "generation_tokens_total", "num_preemptions", "steps",
                                         "decode_plan_bytes_p50",
                                         "layout_mode", "num_switches", "switches_total", "switch_refusals",
                                         "speculative_algorithm", "spec_verify_ct", "spec_draft_tokens",
                                         "spec_accepted_tokens", "spec_accept_length")
                  if k in stats}
        print(json.dumps({"outputs": rows, "engine": engine}))
        return 0
    for o in outs:
        head = o.prompt if o.prompt is not None else f"ids {o.prompt_token_ids}"
        for c in o.outputs:
            tag = f"[{c.index}] " if len(o.outputs) > 1 else ""
            print(f"--- {head!r}")
            print(f"{tag}{c.text}" if c.text else f"{tag}ids {c.token_ids}")
            print(f"    ({len(c.token_ids)} tokens, finish: {c.finish_reason})")
    print(f"engine: {stats.get('model')} {stats.get('dtype')} on {stats.get('device')}, layout "
          f"{stats.get('layout')} x {stats.get('ranks')}, KV pool {stats.get('kv_pool_tokens_per_rank')} "
          f"tokens per rank, {stats.get('kv_distinct_tokens')} distinct")
    if stats.get("spec_verify_ct"):
        print(f"speculative ({stats.get('speculative_algorithm')}): {stats['spec_verify_ct']} verify slices, "
              f"{stats['spec_accepted_tokens']} of {stats['spec_draft_tokens']} drafts accepted, "
              f"{stats['spec_accept_length']:.2f} tokens per verify")
    return 0
