"""`splash bench serve --pd`: 1P1D behind sglang-router against a colocated server, and the KV transfer
against raw Mooncake (a handful of requests on `tiny`; figures parsed, never timed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serve_utils import REPO

from splash.bench.load import request_body
from splash.bench.pd_serve import check_args, table
from splash.bench.pd_transfer import pieces
from splash.cli import build_parser

pytestmark = pytest.mark.timeout(300)


def _mooncake_ok() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401 - needs libibverbs.so.1 (make setup)
    except Exception:  # noqa: BLE001 - not installed, or its library missing
        return False
    return True


def _args(*argv: str):
    return build_parser().parse_args(["bench", "serve", *argv])


@pytest.mark.parametrize("argv, msg", [
    (["--pd"], "--pd needs --model"),
    (["--pd", "--model", "tiny", "--peer", "vllm"], "drop --peer"),
    (["--pd", "--model", "tiny", "--tp", "4"], "--tp 1"),
    (["--pd", "--prefill-url", "http://x"], "go with --router-url"),
    (["--router-url", "http://x"], "go with --pd"),
    (["--model", "tiny", "--theta", "t.json"], "--theta goes with --pd"),
    (["--pd", "--model", "tiny", "--theta", "/nonexistent/t.json"], "no such file"),
])
def test_pd_flags_are_checked(argv, msg):
    problem = check_args(_args(*argv))
    assert problem and msg in problem


def test_pd_defaults_are_the_interference_workload():
    a = _args("--pd", "--model", "tiny", "--input-len", "16")
    assert check_args(a) is None
    assert (a.long_fraction, a.long_input_len, a.max_concurrency, a.num_prompts) == (0.25, 128, 8, 32)
    a = _args("--pd", "--model", "tiny", "--long-fraction", "0.5", "--long-input-len", "40")
    assert check_args(a) is None and (a.long_fraction, a.long_input_len) == (0.5, 40)


def test_generate_body_and_pieces():
    body, path = request_body("m", [1, 2], 5, "generate")
    assert path == "/generate" and body["input_ids"] == [1, 2] and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    assert request_body("m", [1], 2)[1] == "/v1/completions"
    # one piece per (store, layer): pages x page bytes; 2 layers x 16 tokens x 576 x 8 bytes per page
    layout = {"stores": [{"shape": [2, 64, 16, 576], "elem": 8}, {"shape": [2, 64, 16, 128], "elem": 1}]}
    per_page = 2 * 16 * 576 * 8 + 2 * 16 * 128
    assert pieces(layout, 3 * per_page) == [3 * 16 * 576 * 8] * 2 + [3 * 16 * 128] * 2


def test_table_reads_a_result_without_a_colocated_run():
    side = {"output_throughput": 10.0, "mean_ttft_ms": 5.0, "p99_ttft_ms": 9.0, "median_itl_ms": 2.0,
            "p99_itl_ms": 3.0, "max_itl_ms": 4.0, "failed": 0, "errors": []}
    doc = {"model": "tiny", "dtype": "float32", "num_prompts": 2, "input_len": 8, "output_len": 4,
           "long_input_len": 64, "long_fraction": 0.25, "max_concurrency": 2, "request_rate": "inf",
           "cpu": "x", "pd": side, "transfer": None}
    assert "| P99 inter-token latency, ms | 3.0 | - | - |" in table(doc)


@pytest.mark.skipif(not _mooncake_ok(), reason="Mooncake's transfer engine does not import (make setup)")
def test_raw_mooncake_baseline_moves_the_bytes():
    from splash.bench.pd_transfer import raw_throughput

    r = raw_throughput([4096, 8192, 4096], transfers=3, warmup=1)
    assert r["bytes"] == 3 * 16384 and r["transfers"] == 3 and r["bytes_per_s"] > 0


@pytest.mark.skipif(not _mooncake_ok(), reason="Mooncake's transfer engine does not import (make setup)")
def test_bench_serve_pd_smoke():
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (dev extras)")
    r = subprocess.run([sys.executable, "-m", "splash", "bench", "serve", "--pd", "--model", "tiny",
                        "--dtype", "float32", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
                        "--long-input-len", "40", "--long-fraction", "0.5", "--max-concurrency", "2",
                        "--disable-tqdm", "--json"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    for side in ("pd", "colocated"):
        assert (doc[side]["completed"], doc[side]["failed"]) == (4, 0), doc[side]["errors"]
        assert doc[side]["total_output_tokens"] == 4 * 3
    assert set(doc["ratios"]) >= {"output_throughput", "median_itl_ms", "p99_itl_ms", "mean_ttft_ms"}
    t = doc["transfer"]
    assert t["transfers"] == 4 and t["failures"] == 0 and t["bytes"] > 0
    assert t["raw"]["bytes"] == pytest.approx(t["bytes"], rel=0.5) and t["ratio"] > 0
    u = t["raw_under_load"]  # (raw writes of the load's mix during it: 8-token and 40-token prompts in turn)
    assert u["transfers"] > 0 and u["bytes"] > 0 and t["ratio_under_load"] > 0


def test_soak_pd_counts_each_5xx_cause_once():
    from splash.bench.soak_pd import _cause

    line = 'grpo: 503 {"error":{"code":"server_selection_failed","message":"No available prefill workers"}}'
    assert _cause(line) == "503 No available prefill workers"
    assert _cause("greedy: 502 upstream gone") == "502 upstream gone"


@pytest.mark.skipif(not _mooncake_ok(), reason="Mooncake's transfer engine does not import (make setup)")
def test_bench_serve_pd_takes_running_servers_by_url():
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (dev extras)")
    from splash.bench.pd_serve import one_p_one_d

    def serve(port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "splash.cli", "serve", "--model", "tiny", "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]

    with one_p_one_d(serve, None, 120.0) as ((p, d, r), _):
        out = subprocess.run([sys.executable, "-m", "splash", "bench", "serve", "--pd", "--router-url", r,
                              "--prefill-url", p, "--decode-url", d, "--num-prompts", "3", "--input-len", "8",
                              "--output-len", "2", "--long-input-len", "24", "--disable-tqdm", "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["model"] == "tiny" and "colocated" not in doc and doc["pd"]["completed"] == 3
    assert doc["transfer"]["transfers"] == 3


# ---- --prefill-layouts: the prefill-layout study (splash/bench/pd_layouts.py); no server is started ----
@pytest.mark.parametrize("argv, msg", [
    (["--prefill-layouts", "tp,dp"], "go with --pd"),
    (["--decode-tp", "2"], "go with --pd"),
    (["--pd", "--model", "tiny", "--decode-layout", "tp"], "go with --prefill-layouts"),
])
def test_study_flags_go_with_their_mode(argv, msg):
    problem = check_args(_args(*argv))
    assert problem and msg in problem


@pytest.mark.parametrize("argv, msg", [
    (["--prefill-layouts", "tp,xp"], "takes names from"),
    (["--prefill-layouts", "tp,TP"], "twice"),
    (["--prefill-layouts", "tp,auto", "--prefill-tp", "1"], "--prefill-tp >= 2"),
    (["--prefill-layouts", "cp", "--decode-layout", "auto"], "a fixed one"),
    (["--prefill-layouts", "cp", "--router-url", "http://x"], "drop --router-url"),
])
def test_study_flags_are_checked(argv, msg):
    from splash.bench import pd_layouts

    a = _args("--pd", "--model", "tiny", *argv)
    problem = check_args(a) or pd_layouts.check_args(a)
    assert problem and msg in problem


def test_study_defaults():
    from splash.bench import pd_layouts

    a = _args("--pd", "--model", "tiny", "--prefill-layouts", " TP, dop,auto", "--decode-layout",
              "DP-attention")
    assert check_args(a) is None and pd_layouts.check_args(a) is None
    assert a.prefill_layouts == ["tp", "dop", "auto"]
    assert (a.prefill_tp, a.decode_tp, a.decode_layout) == (2, 1, "dp")


def test_mix_reads_the_prompt_lengths_back_from_the_summary():
    from splash.bench.pd_layouts import mix

    assert mix({"completed": 5, "total_input_tokens": 2 * 100 + 3 * 10}, 10, 100) == {10: 3, 100: 2}
    assert mix({"completed": 4, "total_input_tokens": 40}, 10, None) == {10: 4}
    with pytest.raises(ValueError, match="cannot total"):
        mix({"completed": 4, "total_input_tokens": 41}, 10, 100)


def test_expected_bytes_sum_the_manifests_and_the_blind_baseline():
    from splash.bench.pd_layouts import expected_bytes
    from splash.core.pd import Group, blind_bytes, plan_pd
    from splash.core.presets import PRESETS

    cfg, lengths = PRESETS["tiny"], {33: 3, 200: 2}
    link = sum(plan_pd(cfg, Group("cp", 2), Group("dp", 1), s, 16, dtype="float32").link_bytes * n
               for s, n in lengths.items())
    for lay in ("tp", "dp", "cp", "dop"):  # what crosses is what the decode needs, whatever the source
        got = expected_bytes(cfg, [lay], 2, "dp", 1, lengths, 16, "auto", "float32")
        assert got["link_bytes"] == link and got["fill_bytes"] == 0
        blind = sum(blind_bytes(cfg, Group(lay, 2), Group("dp", 1), s, 16, dtype="float32") * n
                    for s, n in lengths.items())
        assert got["blind_bytes_min"] == got["blind_bytes_max"] == blind
    # a TP prefill's two replicas both go to the one decode rank when the transfer is layout-blind
    tp = expected_bytes(cfg, ["tp"], 2, "dp", 1, lengths, 16, "auto", "float32")
    assert tp["blind_bytes_max"] == 2 * link
    # auto that ran in CP and TP: blind bytes as a range; a TP decode completes its second copy inside
    both = expected_bytes(cfg, ["cp", "tp"], 2, "tp", 2, lengths, 16, "auto", "float32")
    assert (both["blind_bytes_min"], both["blind_bytes_max"]) == (2 * link, 4 * link)
    assert both["link_bytes"] == link and both["fill_bytes"] == link


def test_visited_layouts_and_auto_gain():
    from splash.bench.pd_layouts import auto_gain, table, visited

    before = {"layout": "tp", "switches_total": {"tp->cp": 1}}
    assert visited(before, {"layout": "tp", "switches_total": {"tp->cp": 1}}) == ["tp"]
    assert visited(before, {"layout": "cp", "switches_total": {"tp->cp": 2, "cp->dp": 0}}) == ["tp", "cp"]
    bytes_ = {"sent_bytes": 10, "filled_bytes": 0, "link_bytes": 10, "fill_bytes": 0, "blind_bytes_min": 10,
              "blind_bytes_max": 20, "equal_manifest": True}

    def run(p50: float, p99: float, tps: float) -> dict:
        return {"median_ttft_ms": p50, "p99_ttft_ms": p99, "output_throughput": tps, "failed": 0,
                "errors": [], "layouts_seen": ["cp", "tp"], "switches": 1, "bytes": bytes_}

    runs = {"tp": run(100.0, 300.0, 50.0), "cp": run(80.0, 400.0, 40.0), "auto": run(40.0, 150.0, 60.0)}
    g = auto_gain(runs)
    assert (g["median_ttft_ms"]["best_fixed"], g["median_ttft_ms"]["gain"]) == ("cp", 2.0)
    assert (g["p99_ttft_ms"]["best_fixed"], g["p99_ttft_ms"]["gain"]) == ("tp", 2.0)
    assert (g["output_throughput"]["best_fixed"], g["output_throughput"]["gain"]) == ("tp", 1.2)
    assert auto_gain({"tp": runs["tp"]}) is None
    doc = {"model": "tiny", "dtype": "float32", "prefill_tp": 2, "decode_tp": 1, "decode_layout": "dp",
           "num_prompts": 4, "long_fraction": 0.5, "long_input_len": 64, "input_len": 8, "output_len": 4,
           "max_concurrency": 2, "request_rate": "inf", "cpu": "x", "isa": [], "runs": runs, "auto_gain": g}
    text = table(doc)
    assert "| AUTO | CP/TP (1 sw) | 40.0 | 150.0 | 60.0 |" in text and "0.00-0.00 | 1.00-2.00x |" in text
