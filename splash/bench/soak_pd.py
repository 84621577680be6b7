"""`splash bench soak --pd`: the soak's churn (splash/bench/churn.py) through sglang-router in PD mode in
front of a prefill and a decode `splash serve` (T = 1 each, the books check on in both).

The traffic goes to the router; the controller's weight updates, flushes, pauses and memory releases go to
both servers (an update to the prefill and then the decode, inside the greedy checks' lock, so every check
runs on one version on both sides). Once idle (the decode's aborted pages drained), each side is flushed
and read: both must hold no page and no slot. n > 1 through the router: probed once at the start; where
a side refuses it (not built yet with a bootstrap room), an n = 2 draw goes as 2 requests of n = 1 and the
report says so. sglang-router retries an attempt a server answers 5xx (a new room each time), so the
clients see only what is left: the report also gives the router's own count of failed attempts.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

SIDES = ("prefill", "decode")


async def _probe_n(url: str) -> tuple[bool, str]:
    """(send n = 2 as copies?, what the router answered to one n = 2 request)."""
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"n": 2, "max_new_tokens": 2, "temperature": 1.0}}
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(url + "/generate", json=body)
    if r.status_code == 200:
        return False, "n = 2 through the router: 200"
    return True, f"n = 2 through the router: {r.status_code} {r.text[:160]}"


def soak_pd(a: argparse.Namespace, paths: list[str], env: dict[str, str], server: Callable[..., list[str]],
            idle_and_flush: Callable[[str], Any], reference: Callable[..., list[str]]) -> dict[str, Any]:
    """Run the whole soak through 1P1D + router; the report of `soak.format_table`, both sides' leaks.
    `server`, `idle_and_flush`, `reference`: splash/bench/soak.py's (passed in: it imports this module)."""
    from splash.bench.churn import Soak
    from splash.bench.pd_serve import one_p_one_d
    from splash.bench.peer import free_port
    from splash.core.model_config import ConfigError

    if a.tp != 1:
        raise ConfigError("--pd runs each side at --tp 1 (T > 1 on a PD side is not built yet)")
    t0 = time.monotonic()
    # (the router's circuit breaker off: after 10 failed requests it takes the prefill out of rotation
    # for 60 s and answers 503 to everything, which would hide what the servers themselves answer; its
    # metrics on a port of ours, the last --prometheus-port given being the one it takes)
    metrics = free_port()
    flags = ("--disable-circuit-breaker", "--prometheus-port", str(metrics))
    with one_p_one_d(lambda port, *extra: [*server(a, paths[0], port), *extra], env, a.startup_timeout,
                     router_flags=flags) as ((p_url, d_url, r_url), procs):
        vocab = int(httpx.get(d_url + "/v1/models", timeout=10).json()["data"][0]["vocab_size"])
        n_copies, probe = asyncio.run(_probe_n(r_url))
        s = Soak(a, r_url, paths, vocab, servers=[p_url, d_url], n_copies=n_copies)
        asyncio.run(s.run())
        load_s = time.monotonic() - t0
        retried = _router_retries(f"http://127.0.0.1:{metrics}/metrics")
        infos = [asyncio.run(idle_and_flush(u)) for u in (p_url, d_url)]
        healthy = []
        for u in (p_url, d_url):
            try:
                healthy.append(httpx.get(u + "/health", timeout=10).status_code == 200)
            except httpx.HTTPError:
                healthy.append(False)
        codes, logs = [], []
        for proc in procs:
            if proc.poll() is None:
                proc.proc.send_signal(15)
            codes.append(proc.wait(60))
            logs.append(proc.tail(200_000))
    t = s.t
    mismatches = reference(a, paths, t.checks)
    problems = [f"{side}: {ln}" for side, log in zip(SIDES, logs) for ln in log.splitlines()
                if "Traceback" in ln or "books do not balance" in ln or "freed twice" in ln]
    per_side = {side: {"leaked_pages": int(i.get("kv_pages_used", -1)),
                       "leaked_slots": int(i.get("state_slots_used", 0)),
                       "flush_after_idle": i.get("flush_status"),
                       "exit_code": code, "healthy_after": ok, "preemptions": i.get("num_preemptions", 0),
                       "kv_transfers": i.get("kv_transfers_total", 0),
                       "kv_transfer_failures": i.get("kv_transfer_failures_total", 0),
                       "kv_transfer_bytes": i.get("kv_transfer_bytes_total", 0), "error": i.get("error")}
                for side, i, code, ok in zip(SIDES, infos, codes, healthy)}
    leaks = [v["leaked_pages"] for v in per_side.values()]
    slots = [v["leaked_slots"] for v in per_side.values()]
    flushes = [v["flush_after_idle"] for v in per_side.values()]
    return {
        "tp": a.tp, "layout": "1P1D (T=1 each) behind sglang-router", "dtype": a.dtype,
        "requests": sum(t.sent.values()), "by_kind": dict(t.sent), "ok": sum(t.ok.values()),
        "http_5xx": len(t.http_5xx), "client_errors": len(t.client_errors),
        "bad_input_4xx": t.bad_4xx, "bad_input_sent": t.sent["bad"], "unexpected_4xx": len(t.unexpected_4xx),
        "streams_cut": t.cut, "events": dict(t.events), "event_errors": t.event_errors,
        "switches": 0, "preemptions": sum(v["preemptions"] for v in per_side.values()),
        "prefix_cache_hits": infos[0].get("prefix_cache_hits", 0),
        "weight_version": infos[1].get("weight_version"),
        "leaked_pages": -1 if -1 in leaks else sum(leaks), "leaked_slots": -1 if -1 in slots else sum(slots),
        "flush_after_idle": 200 if all(f == 200 for f in flushes) else next(f for f in flushes if f != 200),
        "healthy_after": all(healthy), "exit_code": max(codes, key=abs),
        "greedy_checked": len(t.checks), "greedy_mismatches": len(mismatches),
        "server_log_errors": len(problems), "seconds": round(load_s, 1),
        "pd": {"sides": per_side, "n_as_copies": n_copies, "n_probe": probe, "router_retried": retried,
               "5xx_by_cause": dict(Counter(_cause(x) for x in t.http_5xx).most_common(6))},
        "examples": {"5xx": t.http_5xx[:3], "client": t.client_errors[:3],
                     "unexpected_4xx": t.unexpected_4xx[:3], "mismatch": mismatches[:3], "log": problems[:3]},
        "usage": t.usage, "marks": t.marks,
    }


def _router_retries(url: str) -> dict[str, int] | None:
    """What sglang-router retried unseen by the clients: an attempt the decode answers 5xx is tried again
    (a new room, up to 5 attempts), so the soak's 5xx count is what is left after the retries. None: its
    metrics did not answer. (sglang-router 0.3.2's names; each counted once per worker type: the decode's.)"""
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return None
    names = {"smg_worker_errors_total": "failed_attempts", "smg_worker_retries_total": "retries",
             "smg_worker_retries_exhausted_total": "retries_exhausted"}
    out = dict.fromkeys(names.values(), 0)
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        key = names.get(head.split("{", 1)[0])
        if key is not None and 'worker_type="decode"' in head and value.replace(".", "", 1).isdigit():
            out[key] += int(float(value))
    return out


def _cause(line: str) -> str:
    """A 5xx's kind and status and the start of its message, so the same failure counts once."""
    import json

    kind, _, rest = line.partition(": ")
    code, _, body = rest.partition(" ")
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body
    return f"{code} {msg[:90]}"


def format_pd(r: dict[str, Any]) -> list[str]:
    """The PD rows under the soak's table: each side's leaks and transfers, how n = 2 was sent."""
    pd = r["pd"]
    how = f"sent as 2 requests of n = 1 ({pd['n_probe']})" if pd["n_as_copies"] else "n = 2"
    out = [f"n = 2 draws: {how}"]
    for side, v in pd["sides"].items():
        out.append(f"{side}: leaked pages / slots {v['leaked_pages']} / {v['leaked_slots']}, flush "
                   f"{v['flush_after_idle']}, exit {v['exit_code']}, KV transfers {int(v['kv_transfers'])} "
                   f"({int(v['kv_transfer_failures'])} failed, {v['kv_transfer_bytes'] / 2**20:.1f} MiB)")
    if (rt := pd.get("router_retried")) is not None:
        out.append(f"router: {rt['failed_attempts']} attempts failed (5xx), {rt['retries']} retries, "
                   f"{rt['retries_exhausted']} exhausted (a retry takes a new room; clients see the rest)")
    for cause, count in pd.get("5xx_by_cause", {}).items():
        out.append(f"5xx x{count}: {cause}")
    return out
