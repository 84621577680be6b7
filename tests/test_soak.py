"""`splash bench soak`, short form: a few hundred requests of RL and agent churn (GRPO groups, conversations,
cut streams, n = 2, stop strings, malformed input, greedy checks) through two weight updates, flushes, a
pause and a KV memory release, at T = 1 and at T = 2 under `--layout auto`, against a real server with
the books check on. Nothing may answer 5xx, leak a page or slot once idle and flushed, or change a greedy
answer (replayed alone on a fresh engine). The long form's figures are in docs/performance.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.parametrize("tp", [1, 2])
def test_short_soak(tp: int) -> None:
    cmd = [sys.executable, "-m", "splash", "bench", "soak", "--requests", "200", "--clients", "8",
           "--num-kv-pages", "48",
           "--tp", str(tp), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert p.stdout.strip(), p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["http_5xx"] == 0 and r["client_errors"] == 0 and r["unexpected_4xx"] == 0, r["examples"]
    assert r["bad_input_4xx"] == r["bad_input_sent"] > 0
    assert r["leaked_pages"] == 0 and r["leaked_slots"] == 0 and r["flush_after_idle"] == 200
    assert r["greedy_checked"] > 10 and r["greedy_mismatches"] == 0, r["examples"]["mismatch"]
    assert r["events"].get("update") == 2 and r["events"].get("release") == 2 and not r["event_errors"]
    assert r["preemptions"] > 0 and r["prefix_cache_hits"] > 0  # the small pool really churned
    assert set(r["by_kind"]) == {"grpo", "multiturn", "cut", "n2", "stop", "bad", "greedy"}
    assert r["server_log_errors"] == 0 and r["exit_code"] == 0 and p.returncode == 0
