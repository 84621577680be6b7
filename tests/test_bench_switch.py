"""Smoke tests of `splash bench switch` and `splash bench rollout` at tiny sizes: they run end to end on
two gloo ranks and print the documented JSON (no wall-clock assertions: timings are the benchmark's
output, not a test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENV = dict(os.environ, OMP_NUM_THREADS="1")
DIR_FIELDS = {"from", "to", "bytes_moved", "ready_p50_ms", "blocking_p50_ms", "overlapped_p50_ms",
              "blocking_overhead_p50_ms", "overlapped_overhead_p50_ms", "overlapped_overhead_p95_ms",
              "plan_p50_ms", "cpu_ready_p50_ms", "cpu_blocking_overhead_p50_ms",
              "cpu_overlapped_overhead_p50_ms"}


def splash(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splash", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_bench_switch_json(tmp_path):
    png = tmp_path / "switch.png"
    out = splash("bench", "switch", "--tp", "2", "--batch", "2", "--context", "24", "--repeats", "1",
                 "--remaining", "2", "--page-size", "4", "--json", "--quiet", "--plot", str(png))
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    dirs = doc["directions"]
    assert len(dirs) == 12 and {(d["from"], d["to"]) for d in dirs} == {
        (a, b) for a in ("tp", "dp", "cp", "dop") for b in ("tp", "dp", "cp", "dop") if a != b}
    for d in dirs:
        assert DIR_FIELDS <= set(d), d
        assert d["ready_p50_ms"] > 0 and d["blocking_p50_ms"] > 0 and d["overlapped_p50_ms"] > 0
        assert d["cpu_ready_p50_ms"] > 0  # rank 0's own CPU over a step it computes
    moved = {(d["from"], d["to"]): d["bytes_moved"] for d in dirs}
    # Discards move nothing; gathers of replicated projections move the most (bytes are the plan's).
    assert moved[("tp", "dop")] == moved[("dp", "dop")] == 0
    assert moved[("tp", "dp")] > 0 and moved[("dop", "cp")] > moved[("dop", "tp")] > 0
    assert doc["drain_restart_ms"] > 0 and doc["drain_restart_ms"] == pytest.approx(
        doc["drain_ms"] + doc["restart_ms"])
    assert png.stat().st_size > 0


def test_bench_rollout_json(tmp_path):
    png = tmp_path / "rollout.png"
    out = splash("bench", "rollout", "--tp", "2", "--quick", "--requests", "6", "--output-max", "6",
                 "--runs", "dp,dop,auto", "--min-dwell-steps", "1", "--theta", "h200", "--json", "--quiet",
                 "--plot", str(png), "--keep-runs")
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert set(doc["runs"]) == {"dp", "dop", "auto"}
    gen = {r["generated_tokens"] for r in doc["runs"].values()}
    assert len(gen) == 1 and gen.pop() == doc["workload"]["output_tokens"], "every run does the same work"
    for r in doc["runs"].values():
        assert {"throughput_tok_s", "makespan_s", "switches"} <= set(r)
        assert r["throughput_tok_s"] > 0 and r["timeline"]
    # One budget: DOP's pool holds W_A(1-1/T)/k more tokens per rank than DP's.
    assert doc["runs"]["dop"]["kv_pool_tokens_per_rank"][0] > doc["runs"]["dp"]["kv_pool_tokens_per_rank"][0]
    assert doc["runs"]["dp"]["switches"] == doc["runs"]["dop"]["switches"] == 0
    # The phase analysis covers every run; the oracle bound is priced over the fixed runs only.
    ph = doc["phases"]
    assert set(ph["runs"]) == set(doc["runs"]) and ph["oracle"]["wide_layout"] in {"dp", "dop"}
    bound, gated = ph["oracle"]["makespan_s"], ph["oracle_gated"]["makespan_s"]
    assert 0 < bound <= gated + 1e-9, "gating by memory can only restrict the oracle"
    auto = doc["runs"]["auto"]
    assert all("kv_tokens" in x and "switch_back" in x for x in auto["timeline"])
    assert png.stat().st_size > 0
    # auto ran on the h200 profile prior, corrected online; the ratios come per repeat too
    assert "profile:h200" in auto["theta_source"] and auto["theta_correction"]["dop"]["steps"] > 0
    assert len(doc["auto_vs_best_fixed_each"]) == 1 and doc["auto_vs_best_fixed"] > 0
    # Of the repeats' total times (one repeat here: the runs' own makespans)
    ms = {k: r["makespan_s"] for k, r in doc["runs"].items()}
    assert doc["auto_vs_best_fixed_of_totals"] == pytest.approx(min(ms["dp"], ms["dop"]) / ms["auto"])
    assert doc["auto_vs_oracle_gated_of_totals"] == pytest.approx(doc["auto_vs_oracle_gated_each"][0])
    want = {"predicted_ms", "corrected_ms", "observed_ms", "correction"}
    assert all(want <= set(d) for d in auto["decision_log"])
    # --keep-runs: every run, in the order it ran (one repeat here: each layout's run is its median run)
    every = doc["every_run"]
    assert [(r["repeat"], r["position"]) for r in every] == [(0, 0), (0, 1), (0, 2)]
    assert sorted(r["layout"] for r in every) == ["auto", "dop", "dp"]
    for r in every:
        assert r["timeline"] == doc["runs"][r["layout"]]["timeline"]


def test_bench_bad_input_is_one_line():
    out = splash("bench", "switch", "--tp", "1", timeout=60)
    assert out.returncode == 2 and "needs --tp 2" in out.stderr and "Traceback" not in out.stderr
    out = splash("bench", "switch", "--directions", "dp-tp,tp-tp", timeout=60)
    assert out.returncode == 2 and "'tp-tp' is not a direction" in out.stderr
    assert "Traceback" not in out.stderr
    out = splash("bench", "rollout", "--tp", "2", "--runs", "tp,xx", timeout=60)
    assert out.returncode == 2 and "--runs" in out.stderr and "Traceback" not in out.stderr
