"""`splash plan` and `splash simulate` in-process: JSON shapes, the acceptance numbers, clear errors."""

import json

import pytest

from splash.cli import main


def run_json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on one line
    return json.loads(out)


def test_weights_acceptance(capsys):
    d = run_json(capsys, "plan", "weights", "--model", "deepseek-v3", "--ranks", "8", "--dtype", "bf16")
    assert d["per_layer_mib"] == {"q_b": 72.0, "kv_b": 32.0, "o": 224.0, "total": 328.0}
    assert d["receive_mib_per_rank"] == 287.0 and d["receive_mib_group"] == 2296.0 and d["layers"] == 61
    fp8 = run_json(capsys, "plan", "weights", "--model", "deepseek-v3", "--ranks", "8", "--dtype", "fp8")
    assert fp8["receive_mib_per_rank"] == 143.5
    scaled = run_json(capsys, "plan", "weights", "--dtype", "fp8", "--fp8-scales")
    assert scaled["receive_mib_per_rank"] > 143.5


def test_switches_acceptance(capsys):
    d = run_json(capsys, "plan", "switches", "--model", "deepseek-v3", "--ranks", "8", "--batch", "4",
                 "--context", "4096")
    sw = {(e["from"], e["to"]): e for e in d["switches"]}
    assert len(sw) == 12
    w = {k for k, e in sw.items() if e["weights"]["bytes_per_rank"] > 0}
    kv = {k for k, e in sw.items() if e["kv"]["bytes_per_rank"] > 0}
    assert w == {("TP", "CP"), ("TP", "DP"), ("DOP", "CP"), ("DOP", "DP")}
    assert kv == {("CP", "TP"), ("DP", "TP"), ("DOP", "TP"), ("CP", "DP"), ("CP", "DOP"), ("DP", "CP"),
                  ("DOP", "CP")}
    d2 = run_json(capsys, "plan", "switches", "--ranks", "8", "--batch", "8", "--context", "8192")
    d3 = run_json(capsys, "plan", "switches", "--ranks", "8", "--batch", "16", "--context", "8192")
    for e, e2, e3 in zip(d["switches"], d2["switches"], d3["switches"]):
        assert e2["kv"]["bytes_group"] == pytest.approx(4 * e["kv"]["bytes_group"])  # linear in B*s
        assert e3["kv"]["bytes_per_rank"] == pytest.approx(2 * e2["kv"]["bytes_per_rank"])
        assert e2["weights"] == e["weights"]


@pytest.mark.parametrize("scenario,expect", [
    ("b200", [18.1, 123.0, 253.4]), ("h200", [8.8, 59.8, 123.3]), ("dcu", [14.1, 95.7, 197.1])])
def test_crossovers_acceptance(capsys, scenario, expect):
    d = run_json(capsys, "plan", "crossovers", "--scenario", scenario)
    assert [c["at_k"] for c in d["crossovers"]] == expect
    assert [(c["from"], c["to"]) for c in d["crossovers"]] == [("TP", "DP"), ("DP", "CP"), ("CP", "DOP")]


def test_crossovers_plot_with_limits(capsys, tmp_path):
    png = tmp_path / "fig.png"
    d = run_json(capsys, "plan", "crossovers", "--scenario", "dcu", "--limits", "paper", "--plot", str(png))
    assert d["limits_k"]["DOP"] == 402.8 and [c["at_k"] for c in d["crossovers"]] == [14.1, 95.7, 197.1]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_capacity_shapes(capsys):
    d = run_json(capsys, "plan", "capacity", "--pool-tokens", "TP=1000832,DP=686144,CP=724736,DOP=948352",
                 "--batch", "32", "--ranks", "8", "--cohorts", "4000")
    assert set(d["limits_k"]) == {"TP", "DP", "CP", "DOP"}
    assert d["limits_k"]["TP"] < d["limits_k"]["DP"] < d["limits_k"]["CP"] < d["limits_k"]["DOP"]
    m = run_json(capsys, "plan", "capacity", "--memory-gib", "52.8", "--weights-gib", "24",
                 "--kv-bytes-per-token", "65536", "--batch", "16", "--ranks", "8", "--cohorts", "4000")
    assert m["pool_tokens"] == {"TP": 815923, "DP": 471859, "CP": 471859, "DOP": 815923}
    s = run_json(capsys, "plan", "capacity", "--scenario", "dcu", "--cohorts", "4000")
    assert s["pool_tokens"] == m["pool_tokens"] and s["paper_limits_k"]["TP"] == 58.9
    assert abs(s["limits_k"]["DOP"] / 402.8 - 1) < 0.01


def test_advise(capsys):
    d = run_json(capsys, "plan", "advise", "--model", "deepseek-v3", "--gpu", "h200", "--ranks", "8",
                 "--batch", "32", "--context", "8192")
    assert d["layout"] in d["feasible"]
    assert set(d["layouts"]) == {"TP", "DP", "CP", "DOP"}
    best = min(d["feasible"], key=lambda k: d["layouts"][k]["step_s"])
    assert d["layout"] == best
    dop, dp = d["layouts"]["DOP"], d["layouts"]["DP"]
    assert dop["kv_pool_tokens_per_rank"] > dp["kv_pool_tokens_per_rank"]  # DOP frees W_A (1-1/T)
    assert main(["plan", "advise", "--model", "tiny", "--gpu", "cpu", "--ranks", "4", "--batch", "4",
                 "--context", "256"]) == 0
    assert "-> run" in capsys.readouterr().out


def test_advise_prices_speculation(capsys):
    """`plan advise --speculative-depth K`: each depth's step time and price per token in the chosen layout;
    a narrow batch runs deep, a wide one shallower (verify rows cost real compute there)."""
    base = ["plan", "advise", "--model", "deepseek-v3", "--gpu", "h200", "--ranks", "8", "--context", "8192",
            "--speculative-depth", "3"]
    narrow = run_json(capsys, *base, "--batch", "1")["speculation"]
    wide = run_json(capsys, *base, "--batch", "512")["speculation"]
    assert narrow["depth"] == 3 and narrow["speedup"]["3"] > 1.3
    assert wide["depth"] < narrow["depth"]
    assert all(narrow["step_ms"][str(k + 1)] > narrow["step_ms"][str(k)] for k in range(3))
    none = run_json(capsys, *base, "--batch", "1", "--speculative-accept", "0")["speculation"]
    assert none["depth"] == 0


def test_simulate_rollout_cli(capsys, tmp_path):
    png = tmp_path / "roll.png"
    d = run_json(capsys, "simulate", "rollout", "--model", "tiny", "--gpu", "cpu", "--ranks", "4",
                 "--requests", "12", "--prompt-min", "32", "--prompt-max", "256", "--output-median", "32",
                 "--output-max", "600", "--token-budget", "256", "--plot", str(png))
    assert set(d["runs"]) == {"TP", "DP", "CP", "DOP", "policy"}
    assert d["runs"]["policy"]["output_tokens"] == d["workload"]["output_tokens"]
    assert png.exists()


@pytest.mark.parametrize("argv,needle", [
    (["plan", "weights", "--model", "nope"], "unknown model"),
    (["plan", "weights", "--ranks", "7"], "cannot be split evenly"),
    (["plan", "weights", "--ranks", "0"], "--ranks must be >= 1"),
    (["plan", "weights", "--dtype", "int3"], "unknown dtype"),
    (["plan", "switches", "--context", "-5"], "--context must be >= 0"),
    (["plan", "crossovers", "--scenario", "tpu"], "unknown scenario"),
    (["plan", "capacity"], "exactly one of"),
    (["plan", "capacity", "--pool-tokens", "TP=5,DP=x,CP=1,DOP=1"], "not a number"),
    (["plan", "capacity", "--memory-gib", "10"], "needs --weights-gib"),
    (["plan", "advise", "--batch", "0"], "--batch must be >= 1"),
    (["plan", "advise", "--gpu", "tpu"], "unknown hardware"),
    (["plan", "advise", "--context", "10", "--query-rows", "11"], "cannot exceed"),
    (["simulate", "rollout", "--requests", "0"], "--requests must be >= 1"),
    (["plan", "capacity", "--scenario", "h200", "--batch", "0"], "--batch must be >= 1"),  # was: the default
    (["plan", "capacity", "--scenario", "h200", "--ranks", "0"], "--ranks must be >= 1"),
    (["plan", "advise", "--page-size", "0"], "--page-size must be >= 1"),
    (["plan", "crossovers", "--hi-k", "1e12"], "--hi-k must be at most"),  # was: out of memory
    (["plan", "crossovers", "--hi-k", "inf"], "--hi-k must be at most"),
    (["plan", "switches", "--batch", "16", "--context", "1000000000"], "pages of 64, more than"),
])
def test_invalid_input_is_one_clear_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("splash: error:")


def test_not_a_config_file(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["plan", "weights", "--model", str(bad)]) == 2
    assert "not a JSON model config" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "llama"}))
    assert main(["plan", "weights", "--model", str(other)]) == 2
    assert "not an MLA model" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["plan", "crossovers", "--scenario", "h200", "--plot"],
    ["simulate", "rollout", "--plot"],
    ["bench", "switch", "--plot"],
    ["bench", "sweep", "--plot"],
    ["bench", "rollout", "--plot"],
    ["calibrate", "--tp", "2", "--out"],
])
@pytest.mark.parametrize("path,needle", [("/nonexistent-dir/x.png", "does not exist"),
                                         ("", "expected a file"), (".", "expected a file")])
def test_unwritable_output_is_refused_before_any_work(capsys, argv, path, needle):
    """An output the command could not write is refused when parsed, not after the measurement (whose
    result was then lost with a traceback)."""
    with pytest.raises(SystemExit) as e:
        main([*argv, path])
    assert e.value.code == 2 and needle in capsys.readouterr().err
