"""`splash bench offline --prefix-compare`: the prefix cache off vs on for GRPO groups and agent turns
(the command's arithmetic on tiny-hybrid; the figures live in docs/performance.md)."""

import json

from splash.cli import main


def test_prefix_compare_counts_what_the_cache_saves(capsys):
    B, N, IN, OUT, TURNS, ADD = 2, 3, 24, 4, 2, 8
    argv = ["bench", "offline", "--model", "tiny-hybrid", "--dtype", "float32", "--prefix-compare",
            "--batch", str(B), "--n", str(N), "--input-len", str(IN), "--output-len", str(OUT),
            "--turns", str(TURNS), "--turn-len", str(ADD), "--page-size", "4", "--threads", "1"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    g = doc["grpo"]
    assert g["off"]["prompt_tokens_sent"] == g["on"]["prompt_tokens_sent"] == B * N * IN
    assert g["off"]["prompt_tokens_computed"] == B * N * IN  # every sample prefills its prompt
    # with the cache each prompt once, up to its snapshot point (20 of 24), plus each other sample's rest
    assert g["on"]["prompt_tokens_computed"] == B * IN + B * (N - 1) * (IN - 20)
    assert g["on"]["snapshot_hits"] == B * (N - 1) and g["off"]["snapshot_hits"] == 0
    assert g["off"]["output_tokens"] == g["on"]["output_tokens"] == B * N * OUT
    assert g["computed_ratio"] == g["off"]["prompt_tokens_computed"] / g["on"]["prompt_tokens_computed"]
    t = doc["turns"]
    assert t["off"]["prompt_tokens_sent"] == t["on"]["prompt_tokens_sent"] == B * (IN + (IN + OUT + ADD))
    assert t["off"]["prompt_tokens_computed"] == t["off"]["prompt_tokens_sent"]
    assert t["on"]["prompt_tokens_computed"] < t["off"]["prompt_tokens_computed"]
    assert main(argv) == 0
    assert "prompt tokens computed" in capsys.readouterr().out
