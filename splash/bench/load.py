"""The online load generator behind `splash bench serve` (and its `--peer vllm` runs): random-token
prompts to /v1/completions as token ids, streamed, timed per delivery; the vLLM-style summary.

Prompts of a fixed length, or a seeded mix of two (`ignore_eos`, so every request generates exactly
--output-len tokens) arrive Poisson at --request-rate req/s, or all at once (inf); --max-concurrency
caps requests in flight. The same definitions as vLLM: TPOT = (E2E - TTFT) / (output tokens - 1);
throughputs divide by the wall time from the first send to the last finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each delivery after the first
    latency: float = 0.0
    error: str = ""



def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def _stats_ms(name: str, xs: list[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in xs]
    return {f"mean_{name}_ms": float(np.mean(ms)) if ms else 0.0,
            f"median_{name}_ms": _pct(ms, 50), f"p99_{name}_ms": _pct(ms, 99)}


async def _one(client: httpx.AsyncClient, body: dict[str, Any], prompt_len: int,
               path: str = "/v1/completions") -> RequestResult:
    """One streamed request, timed per delivery. `path` /generate reads SGLang's cumulative objects (what
    sglang-router in PD mode takes token ids on), /v1/completions OpenAI's chunks."""
    res = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    seen = 0  # /generate: tokens delivered so far (each object carries all of them)
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = msg["error"].get("message", str(msg["error"]))
                    return res
                if msg.get("usage"):
                    res.output_tokens = int(msg["usage"].get("completion_tokens", 0))
                if "output_ids" in msg:  # /generate: a delivery when the token list grew
                    grew, seen = len(msg["output_ids"]) > seen, max(seen, len(msg["output_ids"]))
                    res.output_tokens = seen
                else:  # a delivery of tokens: a choice that is not just the closing finish_reason chunk
                    grew = any(c.get("finish_reason") is None for c in msg.get("choices", []))
                if grew:
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                        res.times.append(now)
                    last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "the stream ended without any token"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except Exception:
        return raw[:200].decode(errors="replace")


async def _server_info(client: httpx.AsyncClient, model: str | None) -> dict[str, Any]:
    r = await client.get("/v1/models")
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered HTTP {r.status_code}: {_error_message(r.content)}")
    cards = r.json().get("data", [])
    if not cards:
        raise RuntimeError("the server lists no models")
    if model is None:
        return cards[0]
    card = next((c for c in cards if c.get("id") == model), None)
    if card is None:
        raise RuntimeError(f"the server does not serve {model!r}; it serves "
                           f"{', '.join(str(c.get('id')) for c in cards)}")
    return card


async def benchmark(a: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.max_concurrency or a.num_prompts, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(a.timeout, connect=30.0)) as client:
        card = getattr(a, "card", None) or await _server_info(client, a.model)
        vocab = a.vocab_size if a.vocab_size is not None else card.get("vocab_size")
        if not vocab:
            raise RuntimeError("the server does not report vocab_size; pass --vocab-size")
        max_len = card.get("max_model_len")
        longest = max(a.input_len, a.long_input_len or 0) if a.long_fraction > 0 else a.input_len
        if max_len and longest + a.output_len > max_len:
            raise RuntimeError(f"prompt + --output-len = {longest + a.output_len} exceeds the "
                               f"model's context ({max_len})")
        rng = random.Random(a.seed)
        lens = [a.long_input_len if a.long_fraction > 0 and rng.random() < a.long_fraction else a.input_len
                for _ in range(a.num_prompts)]
        from splash.bench.workloads import cache_counters, conversations

        workload = getattr(a, "workload", "random")
        if workload == "random":
            prompts = [[rng.randrange(int(vocab)) for _ in range(n)] for n in lens]
            convs = [[p] for p in prompts]
        else:
            convs = conversations(workload, a.num_prompts, a.input_len, int(vocab), a.seed,
                                  group_size=getattr(a, "group_size", 8), turns=getattr(a, "turns", 4),
                                  turn_len=getattr(a, "turn_len", 64))
            if max_len and max(len(c[-1]) for c in convs) + a.output_len > max_len:
                raise RuntimeError(f"the last turn + --output-len exceeds the model's context ({max_len})")
        before = await _metrics(client)
        delays, t = [], 0.0
        for _ in convs:
            delays.append(t)
            if math.isfinite(a.request_rate):
                t += rng.expovariate(a.request_rate)
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        from splash.progress import progress_bar

        bar = progress_bar(sum(len(c) for c in convs), "requests", "req", disable=a.disable_tqdm)
        wall0, start = time.time(), time.perf_counter()

        async def send(ids: list[int], delay: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            body, path = request_body(card["id"], ids, a.output_len, getattr(a, "api", "completions"))
            if sem is None:
                r = await _one(client, body, len(ids), path)
            else:
                async with sem:
                    r = await _one(client, body, len(ids), path)
            bar.update(1)
            return r

        peak = {"kv_usage": 0.0}
        done = asyncio.Event()

        async def watch() -> None:  # KV in use at peak: the server's usage gauge, sampled
            while not done.is_set():
                got = cache_counters(await _metrics(client) or "")
                peak["kv_usage"] = max(peak["kv_usage"], got.get("kv_usage", 0.0))
                try:
                    await asyncio.wait_for(done.wait(), 0.5)
                except TimeoutError:
                    pass

        async def converse(conv: list[list[int]], delay: float) -> list[RequestResult]:
            out = [await send(conv[0], delay)]
            for p in conv[1:]:  # the next turn once the previous one has finished
                out.append(await send(p, 0.0))
            return out

        watcher = asyncio.create_task(watch())
        per_conv = await asyncio.gather(*(converse(c, d) for c, d in zip(convs, delays)))
        results = [r for rs in per_conv for r in rs]
        duration = time.perf_counter() - start
        done.set()
        await watcher
        bar.close()
        after = cache_counters(await _metrics(client) or "")
        base = cache_counters(before or "")
        from splash.bench.serve_switches import fetch_events, switch_stalls

        events = await fetch_events(client)
    out = summarize(a, card["id"], results, duration)
    out["workload"] = workload
    q = after.get("prefix_cache_queries", 0.0) - base.get("prefix_cache_queries", 0.0)
    h = after.get("prefix_cache_hits", 0.0) - base.get("prefix_cache_hits", 0.0)
    out["prefix_cache_hit_rate"] = h / q if q > 0 else None
    out["peak_kv_usage"] = peak["kv_usage"]
    gaps = delivery_gaps(results, start)
    out["max_itl_ms"] = max((g for _, g in gaps), default=0.0) * 1e3  # the worst stall
    if events:
        out.update(switch_stalls(gaps, events, wall0))
    if getattr(a, "peer", None) or getattr(a, "pd", False):  # side by side: every ITL with when it ended
        out["itl_timeline"] = itl_timeline(results, start)
    return out


def request_body(model: str, ids: list[int], output_len: int, api: str = "completions"
                 ) -> tuple[dict[str, Any], str]:
    """(body, path) of one streamed greedy request of `output_len` tokens (`ignore_eos`) on `api`:
    "completions" (OpenAI's /v1/completions) or "generate" (SGLang's /generate, token ids)."""
    if api == "generate":
        return ({"input_ids": ids, "stream": True, "sampling_params": {
            "max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}, "/generate")
    return ({"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}, "/v1/completions")


async def _metrics(client: httpx.AsyncClient) -> str | None:
    """The server's Prometheus page, or None where it has none."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def delivery_gaps(results: list[RequestResult], start: float) -> list[tuple[float, float]]:
    """(seconds since the first send, ITL seconds) of every delivery after a request's first."""
    return [(t - start, x) for r in results if r.ok for t, x in zip(r.times, r.itl)]


def itl_timeline(results: list[RequestResult], start: float) -> list[list[float]]:
    """[[seconds since the first send, ITL ms], ...] of every delivery after a request's first, by time."""
    return [[round(t, 4), round(x * 1000.0, 3)] for t, x in sorted(delivery_gaps(results, start))]


def summarize(a: argparse.Namespace, model: str, results: list[RequestResult], duration: float
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out: dict[str, Any] = {
        "base_url": a.base_url, "model": model, "num_prompts": a.num_prompts, "input_len": a.input_len,
        "output_len": a.output_len, "long_input_len": a.long_input_len if a.long_fraction > 0 else None,
        "long_fraction": a.long_fraction,
        "request_rate": a.request_rate if math.isfinite(a.request_rate) else "inf",
        "max_concurrency": a.max_concurrency, "seed": a.seed,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    out.update(_stats_ms("ttft", [r.ttft for r in ok]))
    out.update(_stats_ms("tpot", tpot))
    out.update(_stats_ms("itl", [x for r in ok for x in r.itl]))
    out.update(_stats_ms("e2el", [r.latency for r in ok]))
    return out


def format_table(r: dict[str, Any]) -> str:
    w = 40
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w + 12, c="=")]

    def row(label: str, value: Any, fmt: str = "<10.2f") -> None:
        lines.append(f"{label:<{w}}{value:{fmt}}")

    row("Successful requests:", r["completed"], "<10")
    row("Failed requests:", r["failed"], "<10")
    row("Maximum request concurrency:", str(r["max_concurrency"]), "<10")
    row("Request rate (req/s):", str(r["request_rate"]), "<10")
    row("Benchmark duration (s):", r["duration_s"])
    row("Total input tokens:", r["total_input_tokens"], "<10")
    row("Total generated tokens:", r["total_output_tokens"], "<10")
    if r.get("long_fraction"):
        row("Long prompts (share x tokens):", f"{r['long_fraction']:g} x {r['long_input_len']}", "<10")
    row("Request throughput (req/s):", r["request_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=title, n=w + 12, c="-"))
        name = key.upper()
        row(f"Mean {name} (ms):", r[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", r[f"median_{key}_ms"])
        row(f"P99 {name} (ms):", r[f"p99_{key}_ms"])
    row("Max ITL (ms):", r.get("max_itl_ms", 0.0))
    if r.get("workload", "random") != "random" or r.get("prefix_cache_hit_rate") is not None:
        lines.append("{s:{c}^{n}}".format(s=f"Workload: {r.get('workload')}", n=w + 12, c="-"))
        hit = r.get("prefix_cache_hit_rate")
        row("Prefix cache hit rate (tokens):", "n/a" if hit is None else f"{hit:.1%}", "<10")
        row("Peak KV cache usage:", f"{r.get('peak_kv_usage', 0.0):.1%}", "<10")
    if r.get("num_switches"):
        lines.append("{s:{c}^{n}}".format(s="Live layout switches", n=w + 12, c="-"))
        row("Switches during the load:", r["num_switches"], "<10")
        row("Max ITL across a switch (ms):", r["max_itl_across_switch_ms"])
        row("A switch was the worst stall:", str(r["switch_is_worst_stall"]), "<10")
    lines.append("=" * (w + 12))
    for e in r["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
