"""`splash bench sweep`: JSON/table/PNG of the Figure 4 protocol on one rank (the multi-rank engine is
covered by test_engine_dist.py; this checks the command's shape and its throughput arithmetic)."""

import json

import pytest
from helpers_ckpt import build_checkpoint

from splash.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("sweep"), "v3", seed=2)


def test_sweep_json_table_and_plot(ckpt, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    argv = ["bench", "sweep", "--model", ckpt, "--dtype", "float32", "--device", "cpu", "--tp", "1",
            "--layouts", "dp,dop", "--input-lens", "8,16", "--batch-sizes", "1,3", "--output-len", "4",
            "--page-size", "4", "--threads", "1", "--no-progress"]
    assert main([*argv, "--json", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(p["input_len"], p["batch"]) for p in doc["points"]] == [(8, 1), (8, 3), (16, 1), (16, 3)]
    for p in doc["points"]:
        res = p["results"]
        assert set(res) == {"dp", "dop"}
        for r in res.values():
            want = p["batch"] * (p["input_len"] + p["output_len"]) / r["seconds"]
            assert r["tokens_per_s"] == pytest.approx(want)
            assert r["max_running"] == p["batch"] and r["preemptions"] == 0
        assert p["best"] == max(res, key=lambda k: res[k]["tokens_per_s"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "L_in" in lines[1] and [line.count("*") for line in lines[2:6]] == [1, 1, 1, 1]  # one best each


def test_sweep_bad_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sweep", "--layouts", "tp,zz"])
    assert "subset of" in capsys.readouterr().err
