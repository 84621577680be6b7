"""`splash generate`: run prompts through the offline engine and print the completions (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from splash.commands.argtypes import positive_float, positive_int
from splash.dist.launch import add_launch_args


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
    """Engine options shared by `generate` and `bench offline`."""
    p.add_argument("--model", default="tiny", help="Hugging Face checkpoint directory, or 'tiny' (default)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float64 (default: per device)")
    p.add_argument("--device", default=None, help="cpu | cuda[:i] (default: cuda if present)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="plain torch ops only: no native CPU attention kernel (vLLM's flag; for comparisons)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="bound on the running batch")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget per step (prefill chunk size); default max(512, max-num-seqs)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: model's)")
    add_mixing_args(p)
    add_cache_args(p)
    p.add_argument("--memory-per-rank", default=None,
                   help="memory budget per rank for weights + KV cache, e.g. 2GiB "
                        "(default: from the machine)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    add_launch_args(p)
    from splash.commands.switching import add_switch_args

    add_switch_args(p)  # --layout (auto default at T > 1), --switch-schedule, --switch-mode, --theta, ...
    p.add_argument("--collective-timeout", type=positive_float, default=None, metavar="S",
                   help="seconds before a collective waiting on a dead or hung rank fails the engine "
                        "(default 300)")


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """The prefix cache (splash/kv/prefix.py): vLLM's flags, and SGLang's --disable-radix-cache."""
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share full prompt pages between requests by content (default on, as in vLLM and "
                        "SGLang; off for KDA hybrids, whose per-request state a cached prefix cannot give)")
    p.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
                   help="SGLang's name for --no-enable-prefix-caching")
    p.add_argument("--num-state-slots", type=int, default=None, metavar="N",
                   help="KDA hybrids: requests whose recurrent state a rank holds at once (default "
                        "--max-num-seqs); the scheduler admits no more, the slots come out of the KV budget")


def add_mixing_args(p: argparse.ArgumentParser) -> None:
    """How a step mixes prefill with decode, and the attention form of chunks (docs/performance.md)."""
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="at most N prompt tokens per request per step, so several prompts share a step's "
                        "budget (vLLM's flag; default 0: only --max-num-batched-tokens caps a chunk)")
    p.add_argument("--attention-form", choices=("auto", "absorbed", "mha"), default=None,
                   help="MLA attention form of each chunk: auto (default: the cheaper one per chunk, MHA "
                        "for long prefill chunks), or one pinned everywhere (measurements)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from splash.commands.switching import switch_kwargs

    return {"model": args.model, "dtype": args.dtype, "device": args.device,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "memory_per_rank": args.memory_per_rank, "page_size": args.page_size, "tp": args.tp,
            "layout": args.layout, "nnodes": args.nnodes, "node_rank": args.node_rank,
            "dist_init_addr": args.dist_init_addr, "collective_timeout_s": args.collective_timeout,
            "enforce_eager": getattr(args, "enforce_eager", False),
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
            "attention_form": args.attention_form,
            "enable_prefix_caching": getattr(args, "enable_prefix_caching", None),
            "num_state_slots": getattr(args, "num_state_slots", None),
            **switch_kwargs(args)}


def follow_as_worker(args: argparse.Namespace) -> bool:
    """On a node without rank 0: serve this node's ranks until rank 0 shuts down (True), else False."""
    from splash.engine.group import follow_if_worker

    return follow_if_worker(args.tp, args.nnodes, args.node_rank, args.dist_init_addr, args.device,
                            args.collective_timeout)


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
    from splash.dist.launch import WorkerError
    from splash.engine.sampling import SamplingParams

    try:
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
        llm = LLM(**engine_kwargs(args))
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
                 "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}
                for o in outs for c in o.outputs]
        engine = {k: stats[k] for k in ("model", "dtype", "device", "layout", "ranks", "nnodes",
                                         "kv_pool_tokens", "kv_distinct_tokens", "kv_pool_tokens_per_rank",
                                         "max_request_tokens", "weight_bytes_per_rank", "page_size",
                                         "max_model_len",
                                         "max_num_seqs", "max_num_batched_tokens", "prompt_tokens_total",
                                         "generation_tokens_total", "num_preemptions", "steps",
                                         "decode_plan_bytes_p50",
                                         "layout_mode", "num_switches", "switches_total", "switch_refusals")
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
    return 0
