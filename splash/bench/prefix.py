"""`splash bench offline --prefix-compare`: what the prefix cache saves on RL and agent workloads.

Two workloads, each run with the cache off and on (one engine at a time, the same prompts and seeds):
- **GRPO groups**: `--batch` prompts of `--input-len` tokens, each sampled `--n` times (temperature 1,
  `--output-len` new tokens each, all submitted at once), as an RL rollout sends them. With the cache a
  group's prompt is computed once and its other samples start from it (a KDA hybrid: from the state
  snapshot at the prompt's cacheable end, splash/kv/snapshots.py).
- **Agent turns** (`--turns K`, 0 to skip): `--batch` conversations, each turn resending the whole
  history (the previous prompt, its answer and `--turn-len` new tokens), greedy.

Reported per run: prompt tokens sent, prompt tokens the model computed (the engine's own count,
`prompt_tokens_computed`; recomputes after preemption included), seconds and output tok/s, and the on /
off ratios. One run each; read the ratios beside the machine's noise (~10%).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from splash.bench.workload import random_prompts


def _engine(args: argparse.Namespace, cache: bool, seqs: int) -> Any:
    from splash.config import EngineConfig
    from splash.llm import LLM

    return LLM(config=EngineConfig.from_cli_args(args, enable_prefix_caching=cache,
                                                 max_num_seqs=max(args.max_num_seqs or 64, seqs)))


def _grpo(args: argparse.Namespace, cache: bool) -> dict[str, Any]:
    from splash.engine.sampling import SamplingParams

    with _engine(args, cache, args.batch * args.n) as llm:
        vocab = llm.llm_engine.vocab_size or 256
        llm.generate(prompt_token_ids=random_prompts(2, 16, vocab, args.seed + 1),
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        llm.reset_prefix_cache()
        prompts = random_prompts(args.batch, args.input_len, vocab, args.seed)
        before = llm.stats()["prompt_tokens_computed"]
        params = [SamplingParams(temperature=1.0, n=args.n, max_tokens=args.output_len, ignore_eos=True,
                                 seed=args.seed + i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        st = llm.stats()
    new = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens_sent": args.batch * args.n * args.input_len,
            "prompt_tokens_computed": st["prompt_tokens_computed"] - before, "seconds": dt,
            "output_tokens": new, "output_tokens_per_s": new / dt,
            "snapshot_hits": st.get("prefix_snapshot_hits", 0)}


def _turns(args: argparse.Namespace, cache: bool) -> dict[str, Any]:
    from splash.engine.sampling import SamplingParams

    with _engine(args, cache, args.batch) as llm:
        vocab = llm.llm_engine.vocab_size or 256
        hist = random_prompts(args.batch, args.input_len, vocab, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        before = llm.stats()["prompt_tokens_computed"]
        sent = new = 0
        t0 = time.perf_counter()
        for t in range(args.turns):
            outs = llm.generate(prompt_token_ids=hist, sampling_params=params)
            sent += sum(map(len, hist))
            new += sum(len(o.outputs[0].token_ids) for o in outs)
            more = random_prompts(args.batch, args.turn_len, vocab, args.seed + 100 + t)
            hist = [h + list(o.outputs[0].token_ids) + m for h, o, m in zip(hist, outs, more)]
        dt = time.perf_counter() - t0
        st = llm.stats()
    return {"prompt_tokens_sent": sent, "prompt_tokens_computed": st["prompt_tokens_computed"] - before,
            "seconds": dt, "output_tokens": new, "output_tokens_per_s": new / dt}


def run(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {"model": args.model, "batch": args.batch, "n": args.n, "input_len": args.input_len,
                           "output_len": args.output_len, "turns": args.turns, "turn_len": args.turn_len}
    works = [("grpo", _grpo)] + ([("turns", _turns)] if args.turns else [])
    for name, fn in works:
        off, on = fn(args, False), fn(args, True)
        doc[name] = {"off": off, "on": on,
                     "computed_ratio": off["prompt_tokens_computed"] / max(1, on["prompt_tokens_computed"]),
                     "tok_s_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"]}
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"prefix cache off vs on: {args.model}, {args.batch} prompts x n={args.n}, {args.input_len}+"
          f"{args.output_len}" + (f"; {args.turns} agent turns (+{args.turn_len} tokens each)" if args.turns
                                  else ""))
    print(f"{'workload':10}{'cache':>6}{'prompt sent':>13}{'computed':>10}{'seconds':>9}{'out tok/s':>11}")
    for name, _ in works:
        for side in ("off", "on"):
            r = doc[name][side]
            print(f"{name:10}{side:>6}{r['prompt_tokens_sent']:>13,}{r['prompt_tokens_computed']:>10,}"
                  f"{r['seconds']:>9.2f}{r['output_tokens_per_s']:>11.1f}")
        d = doc[name]
        print(f"{name}: prompt tokens computed {d['computed_ratio']:.2f}x fewer, output tok/s "
              f"{d['tok_s_ratio']:.2f}x with the cache")
    return 0
