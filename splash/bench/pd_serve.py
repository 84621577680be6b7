"""`splash bench serve --pd`: prefill/decode disaggregation (1P1D behind sglang-router in PD mode) against
one colocated server with the same total ranks, on a load where long prompts arrive while others decode.

What PD removes is that interference: on a colocated server a long prompt's prefill shares steps with the
running decodes, so their inter-token latency (ITL) jumps; on 1P1D the prefill runs elsewhere and the
decode only receives the KV. Both setups get the same streamed load (`splash bench serve`'s generator,
splash/bench/load.py, on SGLang's /generate with token ids, as the router in PD mode takes them):
--long-fraction of the prompts --long-input-len tokens (default a quarter at 8x --input-len), at most
--max-concurrency in flight (default 8), so long prompts keep arriving while others decode. Each setup
runs behind sglang-router (PD mode; the colocated server as its one worker in regular mode), so both pay
the same extra hop. One after the other, never both at once: they would share the cores.

Started here (--model): a prefill and a decode `splash serve` at --tp 1 each, each pinned to its half
of the cores (`taskset`, `--threads`: as the colocated server binds its two ranks), and the router; then
the colocated server at --tp 2 (1 + 1 ranks) and a router. Or given (--router-url, a PD router already in
front of a prefill and a decode; --prefill-url / --decode-url for their transfer counters;
--colocated-url for the comparison, else none is run). The transfer: the prefill's own counters over the
measured load (`kv_transfer_bytes_total` / `kv_transfer_seconds_total`, the time of its Mooncake batch
writes) against a raw `batch_transfer_sync_write` of the same bytes in the same pieces between two bare
transfer engines (splash/bench/pd_transfer.py): on the quiet machine after the load, and during the load
from a sender and a receiver process on the prefill's and the decode's cores. The goal (>= 0.8x) is
judged against the latter, the same bytes under the same conditions. With --prefill-layouts, the same
load once per prefill layout instead, at --prefill-tp / --decode-tp ranks (splash/bench/pd_layouts.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from splash.bench.pd_transfer import RawUnderLoad, pieces_for_tokens, taskset
from splash.bench.report import save_figure

# (key in a summary, label, higher is better): the side-by-side rows
METRICS = (("output_throughput", "output tok/s", True), ("mean_ttft_ms", "mean TTFT, ms", False),
           ("p99_ttft_ms", "P99 TTFT, ms", False), ("median_itl_ms", "P50 inter-token latency, ms", False),
           ("p99_itl_ms", "P99 inter-token latency, ms", False),
           ("max_itl_ms", "max inter-token latency, ms", False))
COUNTERS = ("kv_transfer_bytes_total", "kv_transfer_seconds_total", "kv_transfers_total",
            "kv_transfer_failures_total", "kv_transfer_pieces_total")
GOAL = 0.8  # engine / raw transfer throughput


def add_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation: 1P1D + sglang-router (started on --model, or the "
                        "URLs below) against a colocated server at --tp 2, on long prompts arriving while "
                        "others decode; plus the KV transfer against raw Mooncake")
    p.add_argument("--router-url", default=None, help="with --pd: a running PD router (skips the start)")
    p.add_argument("--prefill-url", default=None,
                   help="with --pd --router-url: its prefill (transfer counters)")
    p.add_argument("--decode-url", default=None, help="with --pd --router-url: its decode (model card)")
    p.add_argument("--colocated-url", default=None,
                   help="with --pd --router-url: a colocated server (or a router in front of one) to "
                        "compare")
    # the prefill-layout study (splash/bench/pd_layouts.py)
    p.add_argument("--prefill-layouts", default=None, metavar="L,L,...",
                   help="with --pd: the same load once per prefill layout (tp, dp, cp, dop, auto), a fresh "
                        "1P1D each: TTFT, tok/s, and the KV bytes sent against the core's manifest and a "
                        "layout-blind transfer (no colocated run)")
    p.add_argument("--prefill-tp", type=int, default=None,
                   help="with --prefill-layouts: prefill ranks (default 2)")
    p.add_argument("--decode-tp", type=int, default=None,
                   help="with --prefill-layouts: decode ranks (default 1)")
    p.add_argument("--decode-layout", default=None,
                   help="with --prefill-layouts: the decode's fixed layout, tp|dp|cp|dop (default dp)")
    p.add_argument("--theta", default=None, metavar="FILE",
                   help="with --pd: the servers' --theta (the layout policy's rates, `splash calibrate`)")


def check_args(a: argparse.Namespace) -> str | None:
    """A one-line problem with the --pd flags (or the URL flags without --pd), or None; fills --pd's
    defaults."""
    urls = (a.router_url, a.prefill_url, a.decode_url, a.colocated_url)
    study = (a.prefill_tp, a.decode_tp, a.decode_layout)
    if not a.pd:
        if a.theta:
            return "--theta goes with --pd (the servers it starts)"
        if a.prefill_layouts or any(x is not None for x in study):
            return "--prefill-layouts, --prefill-tp, --decode-tp and --decode-layout go with --pd"
        return ("--router-url, --prefill-url, --decode-url and --colocated-url go with --pd" if any(urls)
                else None)
    if not a.prefill_layouts and any(x is not None for x in study):
        return "--prefill-tp, --decode-tp and --decode-layout go with --prefill-layouts"
    if a.theta and not os.path.isfile(a.theta):
        return f"--theta {a.theta}: no such file (write one with `splash calibrate --out FILE`)"
    if a.peer or a.base_url:
        return "--pd starts (or takes with --router-url) its own servers; drop --peer / --base-url"
    if a.router_url is None and any(urls):
        return "--prefill-url, --decode-url and --colocated-url go with --router-url"
    if a.router_url is None and not a.model:
        return "--pd needs --model (the checkpoint every server loads) or --router-url"
    if a.tp not in (1, 2) or a.layout or a.rounds != 1:
        return ("--pd runs each PD side at --tp 1 and the colocated server at --tp 2; drop --tp, --layout "
                "and --rounds (--prefill-layouts with --prefill-tp / --decode-tp sets each side's size)")
    if a.long_fraction == 0:  # the interference workload unless another mix was asked for
        a.long_fraction, a.long_input_len = 0.25, a.long_input_len or 8 * a.input_len
    if a.max_concurrency is None:
        a.max_concurrency = 8
    if a.num_prompts is None:
        a.num_prompts = 32
    return None


def _serve(a: argparse.Namespace, port: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "splash.cli", "serve", "--model", a.model, "--dtype", a.dtype, "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", a.served, "--log-level", "warning"]
    if (a.max_concurrency or a.num_prompts) > 64:
        cmd += ["--max-num-seqs", str(a.max_concurrency or a.num_prompts)]
    if a.theta:
        cmd += ["--theta", os.path.abspath(a.theta)]
    return cmd + list(extra)


def _router(port: int, *workers: str) -> tuple[list[str], dict[str, str]]:
    from splash.bench.peer import free_port

    cmd = [sys.executable, "-m", "sglang_router.launch_router", *workers, "--host", "127.0.0.1", "--port",
           str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
    # its tokenizer lookup of a local model path goes to the hub: a closed loopback port fails it at once
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1",
           "HF_HOME": os.path.join(tempfile.gettempdir(), "splash-bench-router-hf")}  # (one, reused)
    return cmd, env


def _up(proc: Any, url: str, timeout: float, what: str, route: str = "/health", workers: int = 0) -> float:
    from splash.bench.peer import wait_until

    def ready() -> bool:
        r = httpx.get(url + route, timeout=5)
        return r.status_code == 200 and (not workers or r.json().get("healthy_workers") == workers)

    return wait_until(ready, proc, timeout, what)


def _stats(url: str | None) -> dict[str, float]:
    if not url:
        return {}
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    return {k: float(info.get(k, 0.0)) for k in COUNTERS}


def _card(url: str) -> dict[str, Any]:
    """The model card a server lists first (its name, vocab_size, max_model_len for the load)."""
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def _load(a: argparse.Namespace, url: str, card: dict[str, Any], warmup: bool = False) -> dict[str, Any]:
    """The measured load through `url` (a router), or its short untimed warm-up (first-use costs)."""
    from splash.bench.load import benchmark
    from splash.bench.serve_peer import warmup_args

    args = warmup_args(a) if warmup else a
    return asyncio.run(benchmark(argparse.Namespace(**{**vars(args), "card": card, "base_url": url})))


def _measure_pd(a: argparse.Namespace, router: str, prefill: str | None, decode: str | None,
                cores: list[list[int]] | None = None) -> dict[str, Any]:
    """The load through the PD router and the prefill's transfer counters over it; raw Mooncake writes run
    beside the load, placed as the servers are (`cores`: the prefill's and the decode's, or floating)."""
    card = _card(decode or router)
    _load(a, router, card, warmup=True)
    if not prefill:
        return _load(a, router, card)
    info = httpx.get(prefill + "/get_server_info", timeout=30).json()
    host = prefill.split("//", 1)[-1].rsplit(":", 1)[0]
    layout = httpx.get(f"http://{host}:{int(info['disaggregation_bootstrap_port'])}/route",
                       params={"engine_rank": 0, "target_dp_group": 0}, timeout=30).json()["layout"]
    before = _stats(prefill)  # (after the warm-up: its transfers are not the load's)
    with contextlib.ExitStack() as stack:  # (raw writes beside the load, processes of their own)
        try:
            raw: RawUnderLoad | None = stack.enter_context(
                RawUnderLoad(_raw_plans(a, layout), cores=cores))
        except RuntimeError as e:  # (no local transfer engine: the load's figures still count)
            print(f"splash bench serve --pd: no raw writes during the load: {e}", file=sys.stderr)
            raw = None
        out = _load(a, router, card)
        out["raw_under_load"] = raw.result() if raw is not None else None
    after = _stats(prefill)
    out["transfer"] = {k: after[k] - before[k] for k in COUNTERS}
    out["layout"] = layout
    return out


def _raw_plans(a: argparse.Namespace, layout: dict[str, Any]) -> list[list[int]]:
    """The raw writes beside the load: a short prompt's pieces, and with a long fraction f, one long
    prompt's after every (1 - f) / f short ones (the load's mix)."""
    short = pieces_for_tokens(layout, a.input_len)
    f = float(a.long_fraction or 0)
    if f <= 0 or not a.long_input_len:
        return [short]
    return [short] * max(1, round((1 - f) / f)) + [pieces_for_tokens(layout, a.long_input_len)]


def halves() -> list[list[int]] | None:
    """The cores this process may use, split in two disjoint halves (None under 2 cores): what a
    colocated T = 2 server binds its two ranks to (splash/distributed/affinity.py), so 1P1D's two servers
    get the same cores, one half each, rather than both floating over all of them."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2 or not shutil.which("taskset"):
        return None
    half = len(cores) // 2
    return [cores[:half], cores[half:2 * half]]


def _pinned(cmd: list[str], cores: list[int] | None) -> list[str]:
    """A server's command bound to `cores`, its torch threads one per core."""
    return taskset([*cmd, "--threads", str(len(cores))], cores) if cores else cmd


@contextlib.contextmanager
def one_p_one_d(serve: Callable[..., list[str]], env: dict[str, str] | None, startup_timeout: float,
                pin: bool = False, router_flags: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, str, str], tuple[Any, Any]]]:
    """A prefill and a decode (`serve(port, *mode flags)` is each one's command; `pin`: each on its half
    of the cores) and sglang-router in PD mode in front (`router_flags` added), on free loopback ports, all
    stopped by process id on leaving; yields their URLs (prefill, decode, router) and the two servers'
    PeerProcess objects."""
    from splash.bench.peer import PeerProcess, free_port

    pp, dp, rp, boot = free_port(), free_port(), free_port(), free_port()
    p_url, d_url, r_url = (f"http://127.0.0.1:{x}" for x in (pp, dp, rp))
    cores = halves() if pin else None
    p_cmd = _pinned(serve(pp, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                          str(boot)), cores[0] if cores else None)
    d_cmd = _pinned(serve(dp, "--disaggregation-mode", "decode"), cores[1] if cores else None)
    with PeerProcess(p_cmd, env=env, name="splash serve (prefill)", grace_s=30) as p, \
            PeerProcess(d_cmd, env=env, name="splash serve (decode)", grace_s=30) as d:
        _up(p, p_url, startup_timeout, "the prefill server")
        _up(d, d_url, startup_timeout, "the decode server")
        cmd, renv = _router(rp, "--pd-disaggregation", "--prefill", p_url, str(boot), "--decode", d_url)
        cmd += router_flags  # (last: one of _router's own flags given again here is the one taken)
        with PeerProcess(cmd, env=renv, name="sglang-router (PD)", grace_s=5) as r:
            _up(r, r_url, 120.0, "sglang-router (PD)", "/readiness", workers=2)
            yield (p_url, d_url, r_url), (p, d)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    from splash.bench.peer import PeerProcess, free_port

    a.api = "generate"
    a.served = os.path.basename(os.path.normpath(a.model)) if a.model else "model"
    keys = ("model", "dtype", "num_prompts", "input_len", "output_len", "long_input_len", "long_fraction",
            "max_concurrency")
    doc: dict[str, Any] = {k: getattr(a, k) for k in keys}
    doc["request_rate"] = "inf" if a.request_rate == float("inf") else a.request_rate
    doc["cpu"] = _cpu()
    doc["pd_cores"] = halves()  # (each side's cores; the colocated server binds its ranks the same way)
    if a.router_url:
        if not a.model:  # (given servers: the model they serve, in the dtype they were started with)
            doc["model"] = _card((a.decode_url or a.router_url).rstrip("/")).get("id", "?")
            doc["dtype"] = "as served"
        doc["pd"] = _measure_pd(a, a.router_url.rstrip("/"), a.prefill_url and a.prefill_url.rstrip("/"),
                                a.decode_url and a.decode_url.rstrip("/"))
        if a.colocated_url:
            url = a.colocated_url.rstrip("/")
            _load(a, url, _card(url), warmup=True)
            doc["colocated"] = _load(a, url, _card(url))
    else:
        t0 = time.monotonic()
        with one_p_one_d(lambda port, *extra: _serve(a, port, *extra), None, a.startup_timeout,
                         pin=True) as pd:
            p_url, d_url, r_url = pd[0]
            startup = time.monotonic() - t0
            doc["pd"] = _measure_pd(a, r_url, p_url, d_url, doc["pd_cores"])
            doc["pd"]["startup_s"] = startup
        cp, rp = free_port(), free_port()
        c_url, r_url = f"http://127.0.0.1:{cp}", f"http://127.0.0.1:{rp}"
        t0 = time.monotonic()
        with PeerProcess(_serve(a, cp, "--tp", "2"), name="splash serve (colocated)") as c:
            _up(c, c_url, a.startup_timeout, "the colocated server")
            cmd, env = _router(rp, "--worker-urls", c_url)
            with PeerProcess(cmd, env=env, name="sglang-router", grace_s=5) as r:
                _up(r, r_url, 120.0, "sglang-router", "/readiness", workers=1)
                startup = time.monotonic() - t0
                _load(a, r_url, _card(c_url), warmup=True)
                doc["colocated"] = _load(a, r_url, _card(c_url))
                doc["colocated"]["startup_s"] = startup
    if "colocated" in doc:
        doc["ratios"] = {k: (doc["pd"][k] / doc["colocated"][k] if doc["colocated"].get(k) else None)
                         for k, _, _ in METRICS}
    doc["transfer"] = transfer_report(doc["pd"].pop("transfer", None), doc["pd"].pop("layout", None),
                                      doc["pd"].pop("raw_under_load", None))
    return doc


def transfer_report(t: dict[str, float] | None, layout: dict[str, Any] | None,
                    under_load: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The engine's transfers over the load beside a raw Mooncake write of the same bytes and pieces, on
    the quiet machine after the load (and `under_load`: raw writes of the load's prompt mix during it)."""
    if not t or not layout or t["kv_transfers_total"] <= 0:
        return None
    from splash.bench.pd_transfer import pieces, raw_throughput

    n = int(t["kv_transfers_total"])
    sizes = pieces(layout, t["kv_transfer_bytes_total"] / n)
    raw = raw_throughput(sizes, n)
    busy = raw_throughput(sizes, n, busy_thread=True)  # (what the GIL handoff costs each call)
    secs = t["kv_transfer_seconds_total"]
    engine = t["kv_transfer_bytes_total"] / secs if secs > 0 else 0.0
    ratio = engine / raw["bytes_per_s"] if raw["bytes_per_s"] else None
    loaded = engine / under_load["bytes_per_s"] if under_load and under_load["bytes_per_s"] else None
    # The goal is judged on the same bytes under the same conditions: the raw writes made during the load
    # (same cores, same contention) when there are some, else the quiet machine's.
    judged = loaded if loaded is not None else ratio
    return {"transfers": n, "failures": int(t["kv_transfer_failures_total"]),
            "bytes": int(t["kv_transfer_bytes_total"]), "seconds": t["kv_transfer_seconds_total"],
            "engine_bytes_per_s": engine, "pieces_per_transfer": len(sizes),
            "engine_pieces_per_transfer": t["kv_transfer_pieces_total"] / n,
            "piece_bytes": sorted(set(sizes)),
            "raw": raw, "raw_busy_thread": busy, "ratio": ratio, "goal": GOAL,
            "raw_under_load": under_load, "ratio_under_load": loaded,
            "goal_judged_on": "under_load" if loaded is not None else "quiet",
            "meets_goal": judged is not None and judged >= GOAL}


def _cpu() -> str:
    """The CPU's model name and the vector extensions that matter here (AVX-512, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    ext = [x for x, f in (("AVX-512", "avx512f"), ("AMX", "amx_tile")) if f in flags]
    return f"{name}, {len(os.sched_getaffinity(0))} cores" + (f" ({', '.join(ext)})" if ext else "")


def table(doc: dict[str, Any]) -> str:
    mix = (f"; {doc['long_fraction']:g} of the prompts {doc['long_input_len']} tokens"
           if doc.get("long_fraction") else "")
    lines = [f"serve --pd: {doc['model']} {doc['dtype']}; {doc['num_prompts']} streamed /generate requests "
             f"of {doc['input_len']} + {doc['output_len']} tokens{mix}, "
             f"concurrency {doc['max_concurrency']}, "
             f"rate {doc['request_rate']}; {doc['cpu']}",
             "| metric | 1P1D (T=1 + T=1) | colocated (T=2) | 1P1D / colocated |", "|---|---|---|---|"]
    co = doc.get("colocated") or {}
    for k, label, _ in METRICS:
        r = (doc.get("ratios") or {}).get(k)
        c = f"{co[k]:.1f}" if k in co else "-"
        lines.append(f"| {label} | {doc['pd'][k]:.1f} | {c} | {'-' if r is None else f'{r:.2f}x'} |")
    fails = f"failed requests: 1P1D {doc['pd']['failed']}" + (f", colocated {co['failed']}" if co else "")
    lines.append(fails)
    for e in doc["pd"]["errors"] + co.get("errors", []):
        lines.append(f"error: {e}")
    t = doc.get("transfer")
    if t:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        lines += ["", f"KV transfer: {t['transfers']} transfers, {t['bytes'] / 2**20:.2f} MiB, "
                      f"raw: {t['pieces_per_transfer']} pieces of "
                      f"{', '.join(str(b) for b in t['piece_bytes'])} bytes each; the engine's: "
                      f"{t['engine_pieces_per_transfer']:.1f} pieces a transfer",
                  f"  engine {t['engine_bytes_per_s'] / 2**20:.1f} MiB/s, raw Mooncake on the quiet "
                  f"machine after the load {t['raw']['bytes_per_s'] / 2**20:.1f} MiB/s: {ratio}",
                  f"  raw Mooncake beside one busy Python thread (a server's event loop; the call gives up "
                  f"the GIL and waits to take it back): "
                  f"{t['raw_busy_thread']['bytes_per_s'] / 2**20:.1f} MiB/s"]
        u = t.get("raw_under_load")
        if u and t.get("ratio_under_load") is not None:
            lines.append(f"  raw Mooncake during the load (the load's prompt mix, {u['transfers']} writes "
                         f"from processes of their own on the servers' cores): "
                         f"{u['bytes_per_s'] / 2**20:.1f} MiB/s; engine / that: {t['ratio_under_load']:.2f}x")
        on = "the raw writes during the load" if t.get("goal_judged_on") == "under_load" else "the quiet raw"
        lines.append(f"  goal >= {t['goal']:g}x against {on}: {'met' if t['meets_goal'] else 'NOT met'}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [(k, label) for k, label in (("pd", "1P1D (prefill + decode, T=1 each)"),
                                         ("colocated", "colocated, T=2")) if k in doc]
    fig, axes = plt.subplots(len(sides), 1, figsize=(8, 2.7 * len(sides)), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], sides):
        pts = doc[key].get("itl_timeline") or []
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=5, alpha=0.5, linewidths=0)
        ax.axhline(doc[key]["p99_itl_ms"], color="k", lw=0.8, ls="--")
        ax.set_title(f"{label}: ITL P50 {doc[key]['median_itl_ms']:.1f} ms, "
                     f"P99 {doc[key]['p99_itl_ms']:.1f} ms (dashed)", fontsize=9)
        ax.set_ylabel("inter-token latency, ms")
    axes[-1, 0].set_xlabel("seconds since the first request")
    fig.suptitle(f"{doc['model']}: long prompts ({doc['long_input_len']} tokens) arriving while others "
                 "decode",
                 fontsize=10)
    save_figure(fig, path)


def run(a: argparse.Namespace) -> int:
    """Measure, report (splash/bench/report.py); exit 1 if any request failed on either setup."""
    from splash.bench.report import report

    seen: list[dict[str, Any]] = []

    def go(args: argparse.Namespace) -> dict[str, Any]:
        try:
            seen.append(measure(args))
        except httpx.HTTPError as e:  # a server or the router answering wrong: one line, exit 1
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        return seen[-1]

    code = report("serve", a, go, table, plot)
    if code == 0 and any((seen[-1].get(k) or {}).get("failed") for k in ("pd", "colocated")):
        return 1
    return code
