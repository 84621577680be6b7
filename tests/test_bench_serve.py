"""`splash bench serve` against a live `splash serve --model tiny` (few prompts; numbers not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import REPO, ServeProcess, free_port

API_KEY = "bench-key"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--max-model-len", "128",
                        "--max-num-seqs", "4"], api_key=API_KEY)
    yield srv
    srv.close()


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splash", "bench", "serve", "--disable-tqdm", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def generated_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams["splash:generation_tokens"].samples)


def test_bench_json_has_the_fields(server):
    before = generated_tokens(server.url)
    r = bench("--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "4", "--input-len", "16",
              "--output-len", "6", "--request-rate", "50", "--max-concurrency", "2", "--seed", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["completed"] == 4 and out["failed"] == 0 and out["errors"] == []
    assert out["total_input_tokens"] == 4 * 16
    assert out["total_output_tokens"] == 4 * 6  # ignore_eos: exactly output-len each
    assert generated_tokens(server.url) - before == 4 * 6  # the server saw the same work
    for k in ("request_throughput", "output_throughput", "total_token_throughput", "duration_s"):
        assert out[k] > 0
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < out[f"mean_{m}_ms"] and 0 < out[f"median_{m}_ms"] <= out[f"p99_{m}_ms"]
    assert out["mean_e2el_ms"] >= out["mean_ttft_ms"]
    assert out["max_concurrency"] == 2 and out["request_rate"] == 50


def test_bench_table(server):
    r = bench("--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "2", "--input-len", "8",
              "--output-len", "3")
    assert r.returncode == 0, r.stderr
    for line in ("Serving Benchmark Result", "Successful requests:", "Request throughput (req/s):",
                 "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):"):
        assert line in r.stdout


def test_bench_refuses_lengths_over_the_context(server):
    r = bench("--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "1", "--input-len", "100",
              "--output-len", "100")
    assert r.returncode == 2
    assert "exceeds the model's context" in r.stderr and "Traceback" not in r.stderr


def test_bench_names_a_model_the_server_does_not_serve(server):
    r = bench("--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "1", "--model", "nosuch")
    assert r.returncode == 2 and "does not serve 'nosuch'" in r.stderr and "Traceback" not in r.stderr


def test_bench_reports_failures_with_a_wrong_key(server):
    r = bench("--base-url", server.url, "--api-key", "wrong", "--num-prompts", "1")
    assert r.returncode == 2 and "401" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["--num-prompts", "0"], ["--request-rate", "0"],
                                  ["--max-concurrency", "0"], ["--input-len", "0"], ["--vocab-size", "-5"],
                                  ["--vocab-size", "0"], ["--timeout", "0"], ["--timeout", "-1"]])
def test_bench_bad_arguments(args):
    r = bench("--base-url", "http://127.0.0.1:9", *args, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("splash bench serve:")


def test_bench_unreachable_server():
    r = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1", timeout=60)
    assert r.returncode == 2
    assert "splash bench serve:" in r.stderr and "Traceback" not in r.stderr


def test_bench_mixed_workload_lengths(server):
    r = bench("--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "3", "--input-len", "8",
              "--output-len", "2", "--long-input-len", "40", "--long-fraction", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["total_input_tokens"] == 3 * 40 and out["long_fraction"] == 1 and out["long_input_len"] == 40
    r = bench("--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "8", "--input-len", "8",
              "--output-len", "2", "--long-input-len", "40", "--long-fraction", "0.5", "--seed", "3",
              "--json")
    out = json.loads(r.stdout)
    longs = (out["total_input_tokens"] - 8 * 8) / (40 - 8)
    assert longs == int(longs) and 0 <= longs <= 8, out["total_input_tokens"]
    assert "num_switches" not in out  # one rank: no live switches to report


@pytest.mark.parametrize("args", [["--long-fraction", "1.5", "--long-input-len", "8"],
                                  ["--long-fraction", "0.5"]])
def test_bench_bad_mixed_arguments(args):
    r = bench("--base-url", "http://127.0.0.1:9", *args, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("splash bench serve:") and "long" in r.stderr


def test_switch_stalls_marks_the_gaps_that_wait_across_a_switch():
    from splash.bench.serve_switches import switch_stalls

    wall0 = 1000.0
    gaps = [(0.10, 0.05), (0.30, 0.20), (0.32, 0.02), (0.50, 0.04)]  # (end, length) from the first send
    events = [{"time": 1000.15, "ended": 1000.25, "src": "tp", "dst": "dop", "cause": "auto",
               "exposed_s": 0.01},
              {"time": 999.0, "ended": 999.5, "src": "dop", "dst": "tp", "cause": "auto"}]  # before the load
    out = switch_stalls(gaps, events, wall0)
    assert out["num_switches"] == 1
    [sw] = out["switches"]
    assert sw["deliveries_across"] == 1 and sw["max_itl_across_ms"] == pytest.approx(200.0)
    assert sw["step_ms"] == pytest.approx(100.0) and sw["exposed_ms"] == pytest.approx(10.0)
    assert out["switch_is_worst_stall"] is True
    out = switch_stalls([*gaps, (0.9, 0.3)], events, wall0)
    assert out["switch_is_worst_stall"] is False and out["max_itl_across_switch_ms"] == pytest.approx(200.0)


def test_bench_marks_live_switches_of_a_two_rank_server():
    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--tp", "2", "--layout", "tp",
                        "--max-model-len", "128", "--switch-schedule", "4:dop,10:tp"])
    try:
        r = bench("--base-url", srv.url, "--num-prompts", "4", "--input-len", "8", "--output-len", "16",
                  "--max-concurrency", "4", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        assert info["max_num_batched_tokens"] == 2 * 2048  # the server's default budget at T = 2
        assert out["num_switches"] == 2, out.get("switches")
        assert [(s["src"], s["dst"]) for s in out["switches"]] == [("tp", "dop"), ("dop", "tp")]
        for s in out["switches"]:
            assert s["step_ms"] > 0 and s["deliveries_across"] >= 1  # 4 streams were decoding through it
            assert 0 < s["max_itl_across_ms"] <= out["max_itl_ms"] + 1e-6
    finally:
        srv.close()
