"""`splash bench offline --json-schema`: constrained against unconstrained decoding, per batch (the
command's shape and arithmetic on tiny; the figures themselves live in docs/performance.md)."""

import json

import pytest

from splash.cli import main


def test_structured_bench_json_table_and_plot(tmp_path, capsys):
    pytest.importorskip("xgrammar")
    png = tmp_path / "structured.png"
    argv = ["bench", "offline", "--model", "tiny", "--dtype", "float32", "--json-schema", "builtin",
            "--batches", "1,3", "--input-len", "8", "--output-len", "12", "--repeat", "1", "--threads", "1"]
    assert main([*argv, "--json", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        for side in ("free", "json_schema"):
            s = r[side]
            assert s["steps"] > 0 and s["tokens"] == s["steps"] * r["batch"]
            assert s["tok_per_s"] == pytest.approx(s["tokens"] / s["seconds"])
        assert r["free"]["mask_s"] == 0 and r["json_schema"]["mask_s"] > 0  # only the constrained side masks
        assert 0 < r["json_schema"]["forward_s"] < r["json_schema"]["seconds"]
        assert r["ratio"] == pytest.approx(r["json_schema"]["tok_per_s"] / r["free"]["tok_per_s"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(argv) == 0
    assert "mask ms" in capsys.readouterr().out
    assert main(["bench", "offline", "--model", "tiny", "--json-schema", str(tmp_path / "none.json")]) == 2
    assert "give a JSON schema file" in capsys.readouterr().err
