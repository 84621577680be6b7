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
