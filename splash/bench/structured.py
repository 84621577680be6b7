"""`splash bench offline --json-schema FILE`: what structured outputs cost. Decode tok/s of generation
constrained by a JSON schema against the same batch unconstrained, at each of --batches, and the
grammar's own time per step (masking the step's logits: fill + apply; advancing the matchers).

Both sides decode the same seeded random prompts greedily with `ignore_eos`; only full-batch decode steps
count (every request prefilled, none finished), so a constrained answer that completes early does not
shrink the batch being compared. `builtin` in place of FILE takes an agent-style schema whose answers run
long (an array of records with a minimum count). The schema is compiled once before timing (the
server compiles at admission, off the step loop)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from splash.bench.report import save_figure

BUILTIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "task": {"type": "string", "maxLength": 24},
        "steps": {"type": "array", "minItems": 40, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                           "tool": {"enum": ["search", "read", "write", "run"]},
                           "arg": {"type": "string", "maxLength": 16},
                           "done": {"type": "boolean"}},
            "required": ["id", "tool", "arg", "done"], "additionalProperties": False}},
    },
    "required": ["task", "steps"], "additionalProperties": False,
}


def load_schema(value: str) -> dict[str, Any]:
    if value == "builtin":
        return BUILTIN_SCHEMA
    try:
        with open(value, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise ValueError(f"--json-schema {value}: {e.strerror}; give a JSON schema file or builtin") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {value}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {value}: a JSON schema is an object")
    return schema


def _decode(eng: Any, prompts: list[list[int]], params: Any) -> dict[str, float]:
    """Serve `prompts`; the full-batch decode steps' tokens and seconds, and the grammar's seconds."""
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", prompt_token_ids=p, params=params)
    g = eng.grammar
    tokens = steps = 0
    seconds = mask = accept = forward = 0.0
    while eng.has_unfinished():
        running = eng.scheduler.running
        full = (len(running) == len(prompts) and not eng.scheduler.waiting
                and all(len(s.output_token_ids) >= 1 for s in running))
        m0, a0 = (g.seconds["mask"], g.seconds["accept"]) if g is not None else (0.0, 0.0)
        f0 = eng.forward_seconds
        t0 = time.perf_counter()
        eng.step(final_only=True)
        dt = time.perf_counter() - t0
        if full and len(eng.scheduler.running) == len(prompts):
            tokens += len(prompts)
            steps += 1
            seconds += dt
            forward += eng.forward_seconds - f0
            if g is not None:
                mask += g.seconds["mask"] - m0
                accept += g.seconds["accept"] - a0
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "forward_s": forward, "mask_s": mask,
            "accept_s": accept, "tok_per_s": tokens / seconds if seconds else 0.0}


def run(args: argparse.Namespace) -> int:
    import torch

    from splash.bench.workload import best_run, random_prompts
    from splash.config import EngineConfig
    from splash.engine.sampling import SamplingParams, StructuredOutputs
    from splash.llm import LLM

    try:
        schema = load_schema(args.json_schema)
        batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError("--batches takes positive batch sizes, e.g. 1,16,64")
        llm = LLM(config=EngineConfig.from_cli_args(args, max_num_seqs=max(max(batches),
                                                                        args.max_num_seqs or 0)))
    except (ValueError, FileNotFoundError) as e:
        print(f"splash bench offline: error: {e}", file=sys.stderr)
        return 2
    eng = llm.llm_engine
    backend = eng.grammar_backend()
    spec = StructuredOutputs(json=schema)
    t0 = time.perf_counter()
    backend.compile(spec)
    compile_s = time.perf_counter() - t0
    prompts = random_prompts(max(batches), args.input_len, eng.vocab_size or 256, args.seed)
    kinds = {"free": None, "json_schema": spec}
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, structured_outputs=spec))  # warm-up, both paths
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for name, s in kinds.items():
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                    structured_outputs=s)
            def one(b: int = b, params: Any = params) -> dict[str, Any]:
                llm.reset_prefix_cache()
                return _decode(eng, prompts[:b], params)

            row[name] = best_run(args.repeat, one)
        free, con = row["free"], row["json_schema"]
        row["ratio"] = con["tok_per_s"] / free["tok_per_s"] if free["tok_per_s"] else None
        steps = max(con["steps"], 1)
        row["mask_ms_per_step"] = 1e3 * con["mask_s"] / steps
        row["accept_ms_per_step"] = 1e3 * con["accept_s"] / steps
        row["step_ms_free"] = 1e3 * free["seconds"] / max(free["steps"], 1)
        row["step_ms_constrained"] = 1e3 * con["seconds"] / steps
        # rank 0's host work per step (the step less the ranks' forward): what the grammar adds shows
        # here, apart from the forward's own spread (different tokens route to different experts)
        row["host_ms_free"] = 1e3 * (free["seconds"] - free["forward_s"]) / max(free["steps"], 1)
        row["host_ms_constrained"] = 1e3 * (con["seconds"] - con["forward_s"]) / steps
        extra = row["host_ms_constrained"] - row["host_ms_free"]
        row["grammar_share"] = extra / row["step_ms_constrained"] if row["step_ms_constrained"] else None
        rows.append(row)
    stats = llm.stats()
    doc = {"model": stats.get("model"), "dtype": stats.get("dtype"), "threads": torch.get_num_threads(),
           "input_len": args.input_len, "output_len": args.output_len, "repeat": args.repeat,
           "compile_seconds": compile_s, "rows": rows}
    if args.plot:
        plot(doc, args.plot)
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"structured outputs: {doc['model']} {doc['dtype']}, input {args.input_len}, up to "
          f"{args.output_len} new tokens, {doc['threads']} threads; schema compiled in "
          f"{compile_s * 1e3:.0f} ms")
    print(f"{'batch':>6}{'free tok/s':>12}{'json tok/s':>12}{'ratio':>8}{'step ms':>9}{'host ms':>9}"
          f"{'json host':>11}{'mask ms':>9}{'accept ms':>11}{'share':>8}{'steps':>7}")
    for r in rows:
        print(f"{r['batch']:>6}{r['free']['tok_per_s']:>12.1f}{r['json_schema']['tok_per_s']:>12.1f}"
              f"{(r['ratio'] or 0):>8.3f}{r['step_ms_free']:>9.2f}{r['host_ms_free']:>9.2f}"
              f"{r['host_ms_constrained']:>11.2f}{r['mask_ms_per_step']:>9.3f}{r['accept_ms_per_step']:>11.3f}"
              f"{100 * (r['grammar_share'] or 0):>7.1f}%{r['json_schema']['steps']:>7}")
    print("(per full-batch decode step; host = the step less the ranks' forward; mask = fill + apply of "
          "the bitmask, accept = advancing the matchers; share = extra host time / constrained step)")
    return 0


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.6 * len(rows), 3.6))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [r["free"]["tok_per_s"] for r in rows], w, label="unconstrained")
    ax.bar([x + w / 2 for x in xs], [r["json_schema"]["tok_per_s"] for r in rows], w, label="json_schema")
    for x, r in zip(xs, rows):
        if r["ratio"]:
            ax.annotate(f"{r['ratio']:.2f}x", (x + w / 2, r["json_schema"]["tok_per_s"]), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"structured outputs: {doc['model']} {doc['dtype']}", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)
