"""`splash bench soak`: churn a real server the way RL loops and agents do, then prove nothing was lost.

It starts `splash serve` on a random DeepSeek-V3-shaped checkpoint (two seeds of a built-in preset, A and
B, written once) with a small pool (`--num-kv-pages`, so eviction and preemption happen) and the books
check on (every page and state slot accounted for after each step: a bookkeeping error fails the step
that makes it), and sends `--requests` requests from `--clients` concurrent clients: GRPO groups of 4
identical prompts sent at once, multi-turn conversations resending their history, streams cut mid-way,
n = 2, stop strings, malformed requests (each must get a 4xx and change nothing), and greedy check
requests. Meanwhile a controller pushes `--updates` weight updates mid-flight (A -> B -> A ...),
flushes the cache, pauses (in place) and continues, releases and resumes the KV memory; under
`--layout auto` (T > 1) the policy switches layouts live. Once idle it flushes the cache and reads the
pool: every page and slot must be free. Then every greedy check is replayed on its own (nothing else
running) on a fresh single-rank engine at the weights it ran with, token for token.

With --pd the same churn goes through sglang-router in PD mode in front of a prefill and a decode
server, the controller's events to both, and both must end holding nothing (splash/bench/soak_pd.py).

Greedy checks run under one weight version each (splash/bench/churn.py, the load; the rest of the
traffic runs straight through the updates). Exit status
0 when there were no 5xx, no unexpected client errors, no leaked pages or slots, no mismatch, and the
server stopped cleanly; 1 otherwise. docs/runtime.md "Events and the books" has the rules it checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

from splash.bench.report import save_figure


def register(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("soak", help="churn a server (RL + agent traffic, weight updates, pauses) and check "
                                      "that nothing leaks and greedy answers stay exact",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="built-in model shape to write A and B of (default tiny)")
    p.add_argument("--tp", type=int, default=1, help="ranks (default 1)")
    p.add_argument("--layout", default=None, help="server --layout (default auto at T > 1)")
    p.add_argument("--dtype", default="float64",
                   help="model dtype (default float64: greedy checks compare token for token)")
    p.add_argument("--requests", type=int, default=1000, help="requests to send (default 1000)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--updates", type=int, default=2, help="weight updates mid-flight (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-kv-pages", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=24, help="longest answer a request asks for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=("NGRAM", "MTP"),
                   help="serve with speculative decoding (MTP: A and B get an MTP layer); the greedy checks "
                        "then compare speculative answers with plain decoding")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation: the traffic through sglang-router in PD mode in "
                        "front of a prefill and a decode server (T = 1 each); updates, flushes, pauses and "
                        "releases go to both, and both must end with nothing held")
    p.add_argument("--plot", default=None, metavar="PNG", help="KV usage over time, updates marked")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


async def _idle_and_flush(url: str, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until no request is live, flush the cache, and return the server info (its stats)."""
    import httpx

    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            deadline = time.monotonic() + timeout
            info: dict[str, Any] = {}
            while time.monotonic() < deadline:  # (a PD decode's aborted pages drain for up to 30 s)
                info = (await c.get("/get_server_info")).json()
                if info.get("num_requests", 0) == 0 and not info.get("pd_draining", 0):
                    break
                await asyncio.sleep(0.2)
            flushed = (await c.post("/flush_cache")).status_code
            info = (await c.get("/get_server_info")).json()
            info["flush_status"] = flushed
            return info
    except Exception as e:  # noqa: BLE001 - the server is gone: the report says so
        return {"flush_status": None, "kv_pages_used": -1, "state_slots_used": -1,
                "error": f"{type(e).__name__}: {e}"}


def _reference(a: argparse.Namespace, paths: list[str], checks: list[tuple[int, list[int], int, list[int]]]
               ) -> list[str]:
    """Replay every greedy check on its own on a fresh single-rank engine at its weights."""
    from splash.engine.sampling import SamplingParams
    from splash.llm import LLM

    bad = []
    for version in sorted({v for v, *_ in checks}):
        with LLM(model=paths[version], dtype=a.dtype, num_kv_pages=a.num_kv_pages,
                 enable_prefix_caching=False) as llm:
            for v, ids, n, got in checks:
                if v != version:
                    continue
                p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                want = llm.generate(prompt_token_ids=[ids], sampling_params=p, use_tqdm=False)[0].outputs[0]
                if want.token_ids != got:
                    bad.append(f"weights {'AB'[version]}, prompt of {len(ids)}: got {got[:8]}.., "
                               f"alone {want.token_ids[:8]}..")
    return bad


def _models(a: argparse.Namespace) -> list[str]:
    import dataclasses

    from splash.core.model_config import ConfigError
    from splash.core.presets import PRESETS
    from splash.model.tiny import BUILTIN_MODELS, cache_dir, write_tiny_model

    if a.preset not in BUILTIN_MODELS:
        raise ConfigError(f"--preset {a.preset!r}: choose one of {', '.join(BUILTIN_MODELS)}")
    mtp = getattr(a, "speculative_algorithm", None) == "MTP"  # (A and B with an MTP layer each)
    out = []
    for seed in (0, 1):
        path = os.path.join(cache_dir(), f"soak-{a.preset}{'-mtp' if mtp else ''}-seed{seed}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            os.makedirs(cache_dir(), exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".soak-", dir=cache_dir())
            cfg = PRESETS[a.preset]
            write_tiny_model(tmp, seed=seed, cfg=dataclasses.replace(cfg, num_nextn_predict_layers=1) if mtp
                             else cfg)
            try:
                os.replace(tmp, path)  # (atomic: a concurrent soak wrote the same weights first)
            except OSError:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        out.append(path)
    return out


def _server(a: argparse.Namespace, path: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "splash.cli", "serve", "--model", path, "--dtype", a.dtype, "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", a.served, "--max-num-seqs",
           str(a.max_num_seqs), "--num-kv-pages", str(a.num_kv_pages), "--enable-memory-saver",
           "--log-level", "error"]
    if a.tp > 1:
        cmd += ["--tp", str(a.tp), "--layout", a.layout or "auto"]
    elif a.layout:
        cmd += ["--layout", a.layout]
    if getattr(a, "speculative_algorithm", None):
        cmd += ["--speculative-algorithm", a.speculative_algorithm, "--speculative-num-steps",
                str(a.speculative_num_steps)]
    return cmd


def soak(a: argparse.Namespace) -> dict[str, Any]:
    """Run the whole soak; the report (see `format_table`)."""
    import httpx

    from splash.bench.churn import Soak
    from splash.bench.peer import PeerProcess, free_port, wait_until

    a.served = "soak"
    paths = _models(a)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SPLASH_CHECK_BOOKS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if getattr(a, "pd", False):
        from splash.bench.soak_pd import soak_pd

        return soak_pd(a, paths, env, _server, _idle_and_flush, _reference)
    t0 = time.monotonic()
    with PeerProcess(_server(a, paths[0], port), env=env, name="splash serve (soak)", grace_s=30) as proc:
        wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, proc,
                   a.startup_timeout, "splash serve")
        vocab = int(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["vocab_size"])
        s = Soak(a, url, paths, vocab)
        asyncio.run(s.run())
        load_s = time.monotonic() - t0
        info = asyncio.run(_idle_and_flush(url))
        try:
            healthy = httpx.get(url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if proc.poll() is None:
            proc.proc.send_signal(15)
        code = proc.wait(60)
        log = proc.tail(200_000)
    t = s.t
    mismatches = _reference(a, paths, t.checks)
    problems = [ln for ln in log.splitlines() if "Traceback" in ln or "books do not balance" in ln
                or "freed twice" in ln]
    return {
        "tp": a.tp, "layout": a.layout or ("auto" if a.tp > 1 else "tp"), "dtype": a.dtype,
        "requests": sum(t.sent.values()), "by_kind": dict(t.sent), "ok": sum(t.ok.values()),
        "http_5xx": len(t.http_5xx), "client_errors": len(t.client_errors),
        "bad_input_4xx": t.bad_4xx, "bad_input_sent": t.sent["bad"], "unexpected_4xx": len(t.unexpected_4xx),
        "streams_cut": t.cut, "events": dict(t.events), "event_errors": t.event_errors,
        "switches": info.get("num_switches", 0), "preemptions": info.get("num_preemptions", 0),
        "prefix_cache_hits": info.get("prefix_cache_hits", 0), "weight_version": info.get("weight_version"),
        "leaked_pages": int(info.get("kv_pages_used", -1)),
        "leaked_slots": int(info.get("state_slots_used", 0)),
        "flush_after_idle": info.get("flush_status"), "healthy_after": healthy, "exit_code": code,
        "greedy_checked": len(t.checks), "greedy_mismatches": len(mismatches),
        "server_log_errors": len(problems), "seconds": round(load_s, 1),
        "examples": {"5xx": t.http_5xx[:3], "client": t.client_errors[:3],
                     "unexpected_4xx": t.unexpected_4xx[:3], "mismatch": mismatches[:3], "log": problems[:3]},
        "usage": t.usage, "marks": t.marks,
    }


def passed(r: dict[str, Any]) -> bool:
    return (r["http_5xx"] == 0 and r["client_errors"] == 0 and r["unexpected_4xx"] == 0
            and r["bad_input_4xx"] == r["bad_input_sent"] and r["leaked_pages"] == 0
            and r["leaked_slots"] == 0
            and r["greedy_mismatches"] == 0 and r["server_log_errors"] == 0 and r["exit_code"] == 0
            and r["healthy_after"] and r["flush_after_idle"] == 200 and not r["event_errors"])


def format_table(r: dict[str, Any]) -> str:
    rows = [("ranks / layout / dtype", f"{r['tp']} / {r['layout']} / {r['dtype']}"),
            ("requests sent (by kind)", f"{r['requests']} {r['by_kind']}"),
            ("answered 200", r["ok"]), ("5xx", r["http_5xx"]), ("client errors", r["client_errors"]),
            ("bad input -> 4xx", f"{r['bad_input_4xx']} / {r['bad_input_sent']}"),
            ("unexpected 4xx", r["unexpected_4xx"]), ("streams cut", r["streams_cut"]),
            ("events", r["events"]), ("event errors", len(r["event_errors"])),
            ("layout switches / preemptions", f"{r['switches']} / {r['preemptions']}"),
            ("prefix-cache hit tokens", r["prefix_cache_hits"]),
            ("leaked pages / slots (idle, flushed)", f"{r['leaked_pages']} / {r['leaked_slots']}"),
            ("greedy checked / mismatched", f"{r['greedy_checked']} / {r['greedy_mismatches']}"),
            ("server log errors / exit code", f"{r['server_log_errors']} / {r['exit_code']}"),
            ("seconds", r["seconds"]), ("verdict", "PASS" if passed(r) else "FAIL")]
    w = max(len(k) for k, _ in rows)
    out = ["=" * 20 + " splash bench soak " + "=" * 20]
    out += [f"{k:<{w}}  {v}" for k, v in rows]
    if r.get("pd"):
        from splash.bench.soak_pd import format_pd

        out += format_pd(r)
    for name, ex in r["examples"].items():
        out += [f"  {name}: {e}" for e in ex]
    return "\n".join(out)


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    if r["usage"]:
        xs, ys = zip(*r["usage"])
        ax.plot(xs, [100 * y for y in ys], lw=1)
    for x, what in r["marks"]:
        if what == "update":
            ax.axvline(x, color="r", ls="--", lw=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV in use (%)")
    ax.set_title(f"soak T={r['tp']} {r['layout']}: {r['requests']} requests, updates dashed")
    save_figure(fig, path, dpi=100)


def run(a: argparse.Namespace) -> int:
    for k in ("requests", "clients", "max_num_seqs", "num_kv_pages", "max_tokens", "tp"):
        if getattr(a, k) < 1:
            print(f"splash bench soak: --{k.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if a.updates < 0:
        print("splash bench soak: --updates must be >= 0", file=sys.stderr)
        return 2
    r = soak(a)
    if a.plot:
        plot(r, a.plot)
    slim = {k: v for k, v in r.items() if k not in ("usage", "marks")}
    print(json.dumps(slim) if a.json else format_table(r))
    return 0 if passed(r) else 1
