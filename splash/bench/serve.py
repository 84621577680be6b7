"""`splash bench serve`: an online load generator for a running server, in the style of `vllm bench serve`.

Random-token prompts of a fixed length go to /v1/completions as token ids (`ignore_eos`, so every
request generates exactly --output-len tokens), streamed, so the client times the first token (TTFT)
and every later delivery (ITL). Arrivals are Poisson at --request-rate req/s, or all at once (inf);
--max-concurrency caps requests in flight. The same definitions as vLLM: TPOT = (E2E - TTFT) /
(output tokens - 1); throughputs divide by the wall time from the first send to the last finish.
With --peer vllm it starts `splash serve` and vLLM's OpenAI server on --model itself, one after the other,
runs this load against each and prints both (splash/bench/serve_peer.py); with --pd, 1P1D behind
sglang-router against a colocated server of the same total ranks (splash/bench/pd_serve.py). The load
generator itself is splash/bench/load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

import httpx

from splash.bench.load import benchmark, format_table


def register(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("serve", help="load-test a running server (TTFT, TPOT, ITL, throughput)",
                         description="Send random-token requests to a running `splash serve` (or any "
                                     "OpenAI-compatible server that accepts token-id prompts) and report "
                                     "throughput and latency percentiles.")
    p.add_argument("--base-url", default=None, help="server root (without /v1; default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the server's first); with --peer, the checkpoint both "
                        "servers load: a directory, 'tiny' or 'small'")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default 100; 64 with --peer)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--long-input-len", type=int, default=None,
                   help="a mixed workload: this prompt length for --long-fraction of the requests")
    p.add_argument("--long-fraction", type=float, default=0.0,
                   help="share of requests with --long-input-len prompts (seeded draw; default 0)")
    from splash.bench.workloads import WORKLOADS

    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random prompts (default); grpo: groups of --group-size requests with one prompt; "
                        "multiturn: conversations of --turns turns, each resending the history")
    p.add_argument("--group-size", type=int, default=8, help="grpo: samples per prompt (separate requests)")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--turn-len", type=int, default=64, help="multiturn: new tokens per turn")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default inf: send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default none; 16 with --peer)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids below this (default: the vocab_size /v1/models reports)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    from splash.bench.pd_serve import add_pd_args
    from splash.bench.serve_peer import add_peer_args

    add_peer_args(p)
    add_pd_args(p)
    p.set_defaults(func=run)


def _check_args(a: argparse.Namespace) -> str | None:
    if a.num_prompts is None:
        a.num_prompts = 64 if a.peer else 100
    if a.max_concurrency is None and a.peer:
        a.max_concurrency = 16
    if a.base_url is None and not (a.peer or a.pd):
        a.base_url = "http://127.0.0.1:8000"
    if a.num_prompts < 1:
        return f"--num-prompts must be >= 1, got {a.num_prompts}"
    if a.input_len < 1 or a.output_len < 1:
        return "--input-len and --output-len must be >= 1"
    if not 0.0 <= a.long_fraction <= 1.0:
        return f"--long-fraction must be between 0 and 1, got {a.long_fraction}"
    if a.long_fraction > 0 and (a.long_input_len is None or a.long_input_len < 1):
        return "--long-fraction needs --long-input-len N (N >= 1)"
    if not a.request_rate > 0:
        return f"--request-rate must be > 0 (or inf), got {a.request_rate}"
    if a.max_concurrency is not None and a.max_concurrency < 1:
        return f"--max-concurrency must be >= 1, got {a.max_concurrency}"
    if a.vocab_size is not None and a.vocab_size < 2:
        return f"--vocab-size must be >= 2, got {a.vocab_size}"
    if not 0 < a.timeout < math.inf:
        return f"--timeout must be a positive number of seconds, got {a.timeout}"
    return None


def run(a: argparse.Namespace) -> int:
    from splash.bench import pd_serve
    from splash.bench.serve_peer import check_args

    problem = pd_serve.check_args(a) or _check_args(a) or (None if a.pd else check_args(a))
    if problem:
        print(f"splash bench serve: {problem}", file=sys.stderr)
        return 2
    if a.pd and a.prefill_layouts:  # the prefill-layout study (issue 47)
        from splash.bench import pd_layouts

        return pd_layouts.run(a)
    if a.pd:
        return pd_serve.run(a)
    if a.peer:
        from splash.bench import serve_peer

        return serve_peer.run(a)
    try:
        result = asyncio.run(benchmark(a))
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"splash bench serve: {a.base_url}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else format_table(result))
    return 0 if result["failed"] == 0 else 1
