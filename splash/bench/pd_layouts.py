"""`splash bench serve --pd --prefill-layouts tp,dp,cp,dop,auto`: the same mixed prompt-length load
through 1P1D once per prefill layout (issue 47's measured study), the prefill at --prefill-tp ranks, the
decode at --decode-tp ranks in --decode-layout.

Per prefill layout a fresh prefill, decode and sglang-router (PD mode) come up (`pd_serve.one_p_one_d`;
restarting is the honest way: no warm state, no earlier switch carried over), take the warm-up, then the
measured load (`splash bench serve`'s generator, splash/bench/load.py: --long-fraction of the prompts
--long-input-len tokens, the rest --input-len, a seeded draw). Reported per layout: TTFT P50/P99, output
tok/s, and the transfer: the prefill's `kv_transfer_bytes_total` over the load against the core's manifest
for the same requests (`splash.core.pd.plan_pd`'s `link_bytes`, summed over their prompt lengths) and
against the layout-blind transfer (`blind_bytes`: every prefill rank sends everything it holds to every
decode rank needing any of it); the decode's `kv_fill_bytes_total` against the manifest's `fill_bytes`.
The prompt lengths are read back from the load's own summary (its completed requests' input tokens), so
the expected bytes are those of the requests that ran. A DP/DOP owner does not change any byte total, so
owner 0 stands for every request. `auto` may switch during the load: its blind bytes are given for each
layout it ran in (a range when it ran in several). Last, auto's gain over the best fixed layout.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import httpx

from splash.bench.report import save_figure

FIXED = ("tp", "dp", "cp", "dop")
MIB = 2**20
# (key in a run, label, higher is better): what auto is compared on
GAINS = (("median_ttft_ms", "TTFT P50", False), ("p99_ttft_ms", "TTFT P99", False),
         ("output_throughput", "output tok/s", True))


def check_args(a: argparse.Namespace) -> str | None:
    """A one-line problem with this mode's flags (after `pd_serve.check_args`), or None; fills the
    defaults and turns --prefill-layouts into a list of names."""
    from splash.core.layouts import Layout
    from splash.core.model_config import ConfigError

    if a.router_url:
        return "--prefill-layouts starts a fresh 1P1D per layout; drop --router-url"
    names = [x.strip().lower() for x in str(a.prefill_layouts).split(",") if x.strip()]
    bad = [x for x in names if x not in (*FIXED, "auto")]
    if not names or bad:
        return f"--prefill-layouts takes names from tp, dp, cp, dop, auto; got {a.prefill_layouts!r}"
    if len(set(names)) != len(names):
        return f"--prefill-layouts lists a layout twice: {a.prefill_layouts!r}"
    a.prefill_layouts = names
    a.prefill_tp = 2 if a.prefill_tp is None else a.prefill_tp
    a.decode_tp = 1 if a.decode_tp is None else a.decode_tp
    if a.prefill_tp < 2:
        return "--prefill-layouts compares layouts of the prefill group: it needs --prefill-tp >= 2"
    if a.decode_tp < 1:
        return f"--decode-tp must be >= 1, got {a.decode_tp}"
    try:
        a.decode_layout = Layout.parse(a.decode_layout or "dp").value
    except ConfigError:
        return (f"--decode-layout takes tp, dp, cp or dop (a fixed one: the expected bytes need the decode's "
                f"layout), got {a.decode_layout!r}")
    return None


def mix(run: dict[str, Any], short: int, long: int | None) -> dict[int, int]:
    """{prompt length: requests} of the load's completed requests, read back from its summary: every
    prompt is `short` or `long` tokens, so the input-token total fixes how many were long."""
    n, total = int(run["completed"]), int(run["total_input_tokens"])
    if not long or long == short:
        if total != n * short:
            raise ValueError(f"{n} requests of {short} tokens cannot total {total} input tokens")
        return {short: n} if n else {}
    n_long, rest = divmod(total - n * short, long - short)
    if rest or not 0 <= n_long <= n:
        raise ValueError(f"{n} requests of {short} or {long} tokens cannot total {total} input tokens")
    return {k: v for k, v in ((short, n - n_long), (long, n_long)) if v}


def expected_bytes(cfg: Any, layouts: list[str], prefill_tp: int, decode: str, decode_tp: int,
                   lengths: dict[int, int], page_size: int, kv_format: str, dtype: str) -> dict[str, Any]:
    """Bytes the core plans for requests of `lengths` ({prompt tokens: count}) from a prefill in each of
    `layouts` (the layouts it ran in) at `prefill_tp` ranks to the decode group: the manifest's link and
    fill bytes (the decode's layout fixes them: each needed block crosses once) and the layout-blind
    bytes, min and max over `layouts`."""
    from splash.core.pd import Group, blind_bytes, plan_pd

    dst = Group(decode, decode_tp)
    kw = {"kv_format": kv_format, "dtype": dtype}
    link: set[int] = set()
    fill: set[int] = set()
    blind: list[int] = []
    for lay in layouts:
        src = Group(lay, prefill_tp)
        ms = [(plan_pd(cfg, src, dst, s, page_size, **kw), n) for s, n in lengths.items()]
        link.add(sum(m.link_bytes * n for m, n in ms))
        fill.add(sum(m.fill_bytes * n for m, n in ms))
        blind.append(sum(blind_bytes(cfg, src, dst, s, page_size, **kw) * n for s, n in lengths.items()))
    if len(link) != 1 or len(fill) != 1:  # (the core's rule: what crosses depends on the destination only)
        raise ValueError(f"the manifest's bytes differ between prefill layouts {layouts}: link "
                         f"{sorted(link)}, fill {sorted(fill)}")
    return {"link_bytes": link.pop(), "fill_bytes": fill.pop(), "blind_bytes_min": min(blind),
            "blind_bytes_max": max(blind)}


def _info(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/get_server_info", timeout=30)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def visited(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The layouts a server ran in between two `/get_server_info` reads: the first, and both ends of every
    switch counted in between (`switches_total`, "a->b": n)."""
    seen = {str(before["layout"]).lower(), str(after["layout"]).lower()}
    b0, b1 = before.get("switches_total") or {}, after.get("switches_total") or {}
    for pair, n in b1.items():
        if n > b0.get(pair, 0):
            seen.update(x.strip().lower() for x in pair.split("->"))
    return sorted(seen, key=(*FIXED, *sorted(seen)).index)


def _one(a: argparse.Namespace, layout: str) -> dict[str, Any]:
    """One prefill layout: a fresh 1P1D, the warm-up, the measured load, the counters and expected bytes."""
    from splash.bench.pd_serve import _card, _load, _serve, halves, one_p_one_d
    from splash.core.presets import resolve_model_config

    def serve(port: int, *extra: str) -> list[str]:
        side = ((a.prefill_tp, layout) if "prefill" in extra else (a.decode_tp, a.decode_layout))
        return _serve(a, port, "--tp", str(side[0]), "--layout", side[1], *extra)

    cores = halves()
    pin = bool(cores) and len(cores[0]) >= max(a.prefill_tp, a.decode_tp)  # each side's ranks on own cores
    t0 = time.monotonic()
    with one_p_one_d(serve, None, a.startup_timeout, pin=pin) as ((p_url, d_url, r_url), _):
        startup = time.monotonic() - t0
        card = _card(d_url)
        _load(a, r_url, card, warmup=True)
        p0, d0 = _info(p_url), _info(d_url)  # (after the warm-up: its transfers are not the load's)
        out = _load(a, r_url, card)
        p1, d1 = _info(p_url), _info(d_url)
    out.pop("itl_timeline", None)
    out.update(startup_s=startup, pinned=pin, layouts_seen=visited(p0, p1),
               switches=int(p1.get("num_switches", 0)) - int(p0.get("num_switches", 0)))
    counted = {"sent_bytes": int(p1["kv_transfer_bytes_total"] - p0["kv_transfer_bytes_total"]),
               "filled_bytes": int(d1.get("kv_fill_bytes_total", 0) - d0.get("kv_fill_bytes_total", 0)),
               "transfers": int(p1["kv_transfers_total"] - p0["kv_transfers_total"]),
               "failures": int(p1["kv_transfer_failures_total"] - p0["kv_transfer_failures_total"])}
    lengths = mix(out, a.input_len, a.long_input_len)
    want = expected_bytes(resolve_model_config(a.model), out["layouts_seen"], a.prefill_tp, a.decode_layout,
                          a.decode_tp, lengths, int(p1["page_size"]), str(p1["kv_dtype"]), str(p1["dtype"]))
    out["bytes"] = {**counted, **want, "prompt_lengths": {str(k): v for k, v in lengths.items()},
                    "equal_manifest": counted["sent_bytes"] == want["link_bytes"],
                    "equal_fill": counted["filled_bytes"] == want["fill_bytes"]}
    return out


def auto_gain(runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Per metric of GAINS: the best fixed layout and auto's gain over it (> 1: auto is better)."""
    fixed = {k: v for k, v in runs.items() if k != "auto"}
    if "auto" not in runs or not fixed:
        return None
    out: dict[str, Any] = {}
    for key, _, higher in GAINS:
        best = (max if higher else min)(fixed, key=lambda k: fixed[k][key])
        b, x = fixed[best][key], runs["auto"][key]
        gain = (x / b if higher else b / x) if (x if not higher else b) else None
        out[key] = {"best_fixed": best, "best_value": b, "auto": x, "gain": gain}
    return out


def measure(a: argparse.Namespace) -> dict[str, Any]:
    from splash.bench.pd_serve import _cpu

    a.api = "generate"
    a.served = os.path.basename(os.path.normpath(a.model))
    keys = ("model", "dtype", "num_prompts", "input_len", "output_len", "long_input_len", "long_fraction",
            "max_concurrency", "seed", "prefill_tp", "decode_tp", "decode_layout", "prefill_layouts")
    doc: dict[str, Any] = {"mode": "pd_layouts", **{k: getattr(a, k) for k in keys}}
    doc["request_rate"] = "inf" if a.request_rate == float("inf") else a.request_rate
    doc["cpu"], doc["isa"] = _cpu(), isa()
    doc["runs"] = {lay: _one(a, lay) for lay in a.prefill_layouts}
    doc["auto_gain"] = auto_gain(doc["runs"])
    return doc


def isa() -> list[str]:
    """The vector flags of this CPU that matter for the kernels (AVX-512, its BF16, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
            if f in flags]


def table(doc: dict[str, Any]) -> str:
    lines = [f"serve --pd, prefill layouts: {doc['model']} {doc['dtype']}; prefill T={doc['prefill_tp']}, "
             f"decode {doc['decode_layout'].upper()} T={doc['decode_tp']}; {doc['num_prompts']} streamed "
             f"/generate requests, {doc['long_fraction']:g} of {doc['long_input_len']} prompt tokens, the "
             f"rest {doc['input_len']}, {doc['output_len']} new tokens each, concurrency "
             f"{doc['max_concurrency']}, rate {doc['request_rate']}; {doc['cpu']}; ISA: "
             f"{' '.join(doc['isa']) or '-'}",
             "| prefill layout | ran in | TTFT P50 ms | TTFT P99 ms | out tok/s | sent MiB | manifest link "
             "MiB | sent = manifest | blind MiB | blind / link | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lay, r in doc["runs"].items():
        b = r["bytes"]
        lo, hi = b["blind_bytes_min"], b["blind_bytes_max"]
        blind = f"{lo / MIB:.2f}" if lo == hi else f"{lo / MIB:.2f}-{hi / MIB:.2f}"
        ratio = ("-" if not b["link_bytes"] else f"{lo / b['link_bytes']:.2f}x" if lo == hi
                 else f"{lo / b['link_bytes']:.2f}-{hi / b['link_bytes']:.2f}x")
        ran = "/".join(x.upper() for x in r["layouts_seen"]) + (f" ({r['switches']} sw)" if r["switches"]
                                                                else "")
        lines.append(f"| {lay.upper()} | {ran} | {r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
                     f"{r['output_throughput']:.1f} | {b['sent_bytes'] / MIB:.2f} | "
                     f"{b['link_bytes'] / MIB:.2f} | {'yes' if b['equal_manifest'] else 'NO'} | {blind} | "
                     f"{ratio} | {r['failed']} |")
    lines.append("decode fill inside its group, counted / manifest, MiB: " + ", ".join(
        f"{lay.upper()} {r['bytes']['filled_bytes'] / MIB:.2f} / {r['bytes']['fill_bytes'] / MIB:.2f}"
        for lay, r in doc["runs"].items()))
    pinned = any(r.get("pinned") for r in doc["runs"].values())
    lines.append("cores: " + ("each side pinned to its half of them (taskset)" if pinned else
                              "shared by both sides (too few to give each side's ranks their own)"))
    g = doc.get("auto_gain")
    if g:
        lines.append("auto against the best fixed prefill layout: " + "; ".join(
            f"{label} {g[k]['auto']:.1f} vs {g[k]['best_value']:.1f} ({g[k]['best_fixed'].upper()}): "
            + ("-" if g[k]["gain"] is None else f"{g[k]['gain']:.2f}x") for k, label, _ in GAINS))
    for lay, r in doc["runs"].items():
        lines += [f"error ({lay}): {e}" for e in r["errors"]]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    """Two panels per prefill layout: TTFT P50 and P99 (output tok/s written above), and the bytes sent
    beside the manifest's link bytes and the layout-blind bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(doc["runs"])
    runs = [doc["runs"][k] for k in names]
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (key, label) in enumerate((("median_ttft_ms", "TTFT P50"), ("p99_ttft_ms", "TTFT P99"))):
        bars = ax1.bar(x + (i - 0.5) * 0.38, [r[key] for r in runs], 0.38, label=label)
        if i == 1:
            for b, r in zip(bars, runs):
                ax1.annotate(f"{r['output_throughput']:.0f} tok/s", (b.get_x(), b.get_height()), fontsize=7,
                             xytext=(0, 2), textcoords="offset points")
    ax1.set_ylabel("ms")
    ax1.set_title("time to first token (output tok/s above)", fontsize=9)
    series = (("sent_bytes", "sent (prefill's counter)"), ("link_bytes", "manifest link"),
              ("blind_bytes_max", "layout-blind"))
    for i, (key, label) in enumerate(series):
        ax2.bar(x + (i - 1) * 0.27, [r["bytes"][key] / MIB for r in runs], 0.27, label=label)
    ax2.set_ylabel("MiB over the load")
    ax2.set_title("KV bytes from prefill to decode", fontsize=9)
    for ax in (ax1, ax2):
        ax.set_xticks(x, [n.upper() for n in names])
        ax.set_xlabel("prefill layout")
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['model']} {doc['dtype']}: prefill T={doc['prefill_tp']} per layout, decode "
                 f"{doc['decode_layout'].upper()} T={doc['decode_tp']}; prompts {doc['input_len']} / "
                 f"{doc['long_input_len']} tokens", fontsize=10)
    save_figure(fig, path)


def run(a: argparse.Namespace) -> int:
    """Check this mode's flags, measure, report (splash/bench/report.py); exit 1 if any request failed
    or a counted byte total differs from the manifest's."""
    import sys

    from splash.bench.report import report

    problem = check_args(a)
    if problem:
        print(f"splash bench serve: {problem}", file=sys.stderr)
        return 2
    seen: list[dict[str, Any]] = []

    def go(args: argparse.Namespace) -> dict[str, Any]:
        try:
            seen.append(measure(args))
        except httpx.HTTPError as e:  # a server or the router answering wrong: one line, exit 1
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        return seen[-1]

    code = report("serve", a, go, table, plot)
    runs = seen[-1]["runs"].values() if seen else ()
    if code == 0 and any(r["failed"] or not r["bytes"]["equal_manifest"] for r in runs):
        return 1
    return code
