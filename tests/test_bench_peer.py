"""`bench offline|serve --peer vllm` without vLLM: argument checks, the missing-venv error, the result
tables and JSON from a fake peer, the stop-by-process-id logic, and both commands end to end against a
stand-in `vllm` package (a fake venv whose python sees it) on the tiny model."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import sys
import textwrap
import time

import pytest

from splash.bench import offline_peer, peer, serve_peer
from splash.bench.load import RequestResult, itl_timeline
from splash.cli import main

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse refusals
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ---- arguments and the missing venv -----------------------------------------------------------------
@pytest.mark.parametrize("argv, msg", [
    (["bench", "offline", "--peer", "vllm", "--compare-hf"], "choose one"),
    (["bench", "offline", "--peer", "vllm", "--dtype", "float32"], "bf16 only"),
    (["bench", "offline", "--peer", "vllm", "--layout", "auto", "--tp", "2"], "fixed layouts"),
    (["bench", "offline", "--shapes", "1x2x3"], "--shapes goes with --peer"),
    (["bench", "offline", "--peer", "vllm", "--shapes", "16x32"], "BATCHxPROMPTxNEW"),
    (["bench", "offline", "--peer", "vllm", "--shapes", "0x32x4"], "BATCHxPROMPTxNEW"),
    (["bench", "offline", "--peer", "sglang"], "invalid choice"),
    (["bench", "serve", "--peer", "vllm"], "--peer needs --model"),
    (["bench", "serve", "--peer", "vllm", "--model", "tiny", "--base-url", "http://x"], "drop --base-url"),
    (["bench", "serve", "--peer", "vllm", "--model", "tiny", "--vocab-size", "9"], "drop --vocab-size"),
    (["bench", "serve", "--layout", "dop"], "go with --peer"),
    (["bench", "serve", "--rounds", "2"], "go with --peer"),
])
def test_bad_peer_flags_get_one_line(capsys, monkeypatch, tmp_path, argv, msg):
    monkeypatch.setenv("SPLASH_PEER_VENV", str(tmp_path / "none"))
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and msg in err and "Traceback" not in err, err


@pytest.mark.parametrize("kind", ["offline", "serve"])
def test_missing_venv_says_run_make_peer_venv(capsys, monkeypatch, tmp_path, kind):
    monkeypatch.setenv("SPLASH_PEER_VENV", str(tmp_path / "none"))
    code, out, err = run_cli(capsys, "bench", kind, "--peer", "vllm", "--model", "tiny")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("run make peer-venv"), err


def test_peer_python_finds_a_venv(tmp_path, monkeypatch):
    py = tmp_path / "v" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    monkeypatch.setenv("SPLASH_PEER_VENV", str(tmp_path / "v"))
    with pytest.raises(peer.PeerMissing):  # not executable: not a venv
        peer.peer_python()
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    assert peer.peer_python() == str(py)


def test_peer_env_and_thread_binding(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = peer.peer_env(1, 1.5, cores=2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1.5" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "PYTHONPATH" not in env  # splash's path must not shadow the peer venv's packages
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert peer.peer_env(1, cores=2)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # the user's choice wins
    assert peer.thread_binding(1, cores=1) == "0"
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in peer.peer_env(1, cores=2, python=str(tmp_path / "bin" / "python"))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = peer.peer_env(1, cores=2, python=str(tmp_path / "bin" / "python"))
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")  # vLLM's CPU guide: Intel OpenMP
    assert peer.thread_binding(2, cores=2) == "0|1"
    assert peer.thread_binding(2, cores=16) == "0-7|8-15"
    assert peer._id_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError, match="at least 4 cores"):
        peer.thread_binding(4, cores=2)


# ---- result shapes from a fake peer -----------------------------------------------------------------
def fake_offline_doc(layouts=("tp",), tp=1):
    shapes = [(2, 8, 4), (3, 16, 5)]
    args = argparse.Namespace(model="small", tp=tp, repeat=2, seed=0)
    splash = {lay: [{"seconds": 0.5, "tokens": [[1, 2, 3, 4], [5, 6, 7, 8]]},
                    {"seconds": 1.0, "tokens": [[1, 1, 1, 1, 1], [2, 2, 2, 2, 2], [3, 3, 3, 3, 3]]}]
              for lay in layouts}
    vllm = {"version": "0.32.0", "load_seconds": 70.0,
            "shapes": [{"seconds": 1.0, "tokens": [[1, 2, 9, 9], [5, 6, 7, 8]]},
                       {"seconds": 0.5, "tokens": [[1, 1, 1, 1, 1], [9, 2, 2, 2, 2], [3, 3, 3, 3, 3]]}]}
    return offline_peer.build_doc(args, shapes, splash, vllm)


def test_offline_doc_rates_ratios_and_agreement(tmp_path):
    doc = fake_offline_doc()
    json.dumps(doc)  # JSON-serialisable
    a, b = doc["rows"]
    assert (a["batch"], a["input_len"], a["output_len"]) == (2, 8, 4)
    assert a["splash"]["tp"]["output_tokens_per_s"] == pytest.approx(2 * 4 / 0.5)
    assert a["vllm"]["output_tokens_per_s"] == pytest.approx(2 * 4 / 1.0)
    assert a["ratio"]["tp"] == pytest.approx(2.0) and b["ratio"]["tp"] == pytest.approx(0.5)
    assert a["agreement"]["tp"] == {"first_token": 1.0, "prefix": pytest.approx((2 / 4 + 1) / 2)}
    assert b["agreement"]["tp"]["first_token"] == pytest.approx(2 / 3)
    text = offline_peer.table(doc)
    assert "| 2 x 8 x 4 | 16 | 8 | 2.00x | 2/2 (prefix 75%) |" in text
    assert "| 3 x 16 x 5 | 15 | 30 | 0.50x | 2/3 (prefix 67%) |" in text
    offline_peer.plot(doc, str(tmp_path / "bars.png"))
    assert (tmp_path / "bars.png").stat().st_size > 1000


def test_offline_table_names_each_layout_on_two_ranks():
    doc = fake_offline_doc(layouts=("tp", "dop"), tp=2)
    head = offline_peer.table(doc).splitlines()[1]
    assert "splash tp tok/s" in head and "splash dop / vLLM" in head and "first tokens agree (dop)" in head
    assert offline_peer.layouts_for(argparse.Namespace(tp=2, layout=None)) == ["tp", "dop"]
    assert offline_peer.layouts_for(argparse.Namespace(tp=2, layout="cp")) == ["cp"]
    assert offline_peer.layouts_for(argparse.Namespace(tp=None, layout=None)) == [None]


def summary(tput, ttft, tpot, p99, failed=0):
    timeline = [[0.1 * i, 20.0 + i] for i in range(20)]
    s = {"completed": 4, "failed": failed, "max_concurrency": 2, "request_rate": "inf", "duration_s": 1.0,
         "total_input_tokens": 64, "total_output_tokens": 32, "request_throughput": 4.0, "errors": [],
         "output_throughput": tput, "total_token_throughput": 3 * tput, "itl_timeline": timeline,
         "startup_s": 3.0}
    for m in ("ttft", "tpot", "itl", "e2el"):
        s.update({f"mean_{m}_ms": 10.0, f"median_{m}_ms": 10.0, f"p99_{m}_ms": 20.0})
    s.update(mean_ttft_ms=ttft, mean_tpot_ms=tpot, p99_itl_ms=p99, max_itl_ms=2 * p99)
    return s


def test_serve_doc_table_ratios_and_itl_plot(tmp_path):
    doc = {"model": "small", "dtype": "bfloat16", "tp": 1, "layout": None, "num_prompts": 4, "input_len": 16,
           "output_len": 8, "max_concurrency": 2, "peer": "vllm",
           "splash": summary(360.0, 450.0, 40.0, 170.0), "vllm": summary(720.0, 300.0, 20.0, 34.0)}
    doc["ratios"] = serve_peer.ratios(doc["splash"], doc["vllm"])
    assert doc["ratios"] == {"output_throughput": 0.5, "mean_ttft_ms": 1.5, "mean_tpot_ms": 2.0,
                             "p99_itl_ms": 5.0, "max_itl_ms": 5.0}
    text = serve_peer.table(doc)
    assert text.count("Serving Benchmark Result") == 2
    for row in ("| output tok/s | 360.0 | 720.0 | 0.50x |", "| mean TTFT, ms | 450.0 | 300.0 | 1.50x |",
                "| mean TPOT, ms | 40.0 | 20.0 | 2.00x |",
                "| P99 inter-token latency, ms | 170.0 | 34.0 | 5.00x |"):
        assert row in text
    serve_peer.plot(doc, str(tmp_path / "itl.png"))
    assert (tmp_path / "itl.png").stat().st_size > 1000


def test_itl_timeline_is_every_later_delivery_by_time():
    a = RequestResult(ok=True, itl=[0.02, 0.03], times=[10.5, 10.53])
    b = RequestResult(ok=True, itl=[0.05], times=[10.4])
    bad = RequestResult(ok=False, itl=[1.0], times=[10.1])
    assert itl_timeline([a, b, bad], start=10.0) == [[0.4, 50.0], [0.5, 20.0], [0.53, 30.0]]


# ---- the child process is stopped by its id -------------------------------------------------------------
def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


SPAWNER = textwrap.dedent("""
    import signal, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")


def start_spawner(tmp_path, mode: str, grace: float = 2.0) -> tuple[peer.PeerProcess, int]:
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNER)
    proc = peer.PeerProcess([sys.executable, str(script), mode], name="dummy", grace_s=grace,
                            log_path=str(tmp_path / f"{mode}.log"))
    end = time.monotonic() + 30
    while not proc.tail().strip() and time.monotonic() < end:
        time.sleep(0.05)
    return proc, int(proc.tail().split()[0])


def test_stop_ends_the_process_and_its_children(tmp_path):
    proc, grandchild = start_spawner(tmp_path, "polite")
    assert alive(proc.pid) and alive(grandchild)
    assert proc.stop() == -signal.SIGTERM
    assert wait_gone(proc.pid) and wait_gone(grandchild)
    assert proc.stop() == -signal.SIGTERM  # idempotent


def test_a_process_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    proc, grandchild = start_spawner(tmp_path, "stubborn", grace=0.5)
    t0 = time.monotonic()
    assert proc.stop() == -signal.SIGKILL
    assert time.monotonic() - t0 < 10 and wait_gone(grandchild)


def test_leaving_the_block_on_an_error_or_ctrl_c_stops_it(tmp_path):
    for exc in (RuntimeError("load failed"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with start_spawner(tmp_path, "polite")[0] as proc:
                raise exc
        assert wait_gone(proc.pid)


def test_wait_until_fails_at_once_when_the_server_dies(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('ValueError: no such model'); sys.exit(3)"]
    with peer.PeerProcess(cmd, name="fake server") as proc:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="fake server failed: ValueError: no such model"):
            peer.wait_until(lambda: False, proc, timeout=60, what="fake server")
        assert time.monotonic() - t0 < 30
    with peer.PeerProcess([sys.executable, "-c", "import time; time.sleep(60)"], name="slow") as proc:
        with pytest.raises(TimeoutError, match="not ready after"):
            peer.wait_until(lambda: False, proc, timeout=0.3, what="slow", interval=0.05)


# ---- end to end against a stand-in vLLM ---------------------------------------------------------------
FAKE_VLLM = '''
"""A stand-in for vLLM's offline API: greedy "generation" that repeats the last prompt token."""
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, max_tokens, temperature, detokenize, ignore_eos):
        assert temperature == 0.0 and detokenize is False and ignore_eos is True
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, model, skip_tokenizer_init, dtype, tensor_parallel_size, max_model_len, max_num_seqs,
                 seed):
        import os
        assert skip_tokenizer_init and dtype == "bfloat16" and os.path.isfile(model + "/config.json")
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] not in ("", "auto")
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"

    def generate(self, prompts, params, use_tqdm=False):
        return [_Req([p["prompt_token_ids"][-1]] * params.max_tokens) for p in prompts]
'''
FAKE_SERVER = '''
"""A stand-in for vLLM's OpenAI server: splash serve with the same flags (exec: the same process id)."""
import argparse, os, sys
p = argparse.ArgumentParser()
for f in ("--model", "--served-model-name", "--dtype", "--host", "--port", "--tensor-parallel-size"):
    p.add_argument(f)
a = p.parse_args()
assert float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) in (2.0, 0.02)  # --peer-kv-gib reaches the peer
os.execv(sys.executable, [sys.executable, "-m", "splash.cli", "serve", "--model", a.model,
                          "--served-model-name", a.served_model_name, "--dtype", a.dtype, "--host", a.host,
                          "--port", a.port, "--max-model-len", "256"])
'''


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "vllm"
    (pkg / "entrypoints" / "openai").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(FAKE_SERVER)
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}:{REPO}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    monkeypatch.setenv("SPLASH_PEER_VENV", str(tmp_path / "venv"))
    return tmp_path


def test_offline_peer_end_to_end_with_a_stand_in(fake_venv, capsys):
    code, out, err = run_cli(capsys, "bench", "offline", "--model", "tiny", "--peer", "vllm", "--shapes",
                             "2x8x3,1x4x2", "--repeat", "1", "--json", "--max-num-seqs", "4")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["peer_version"] == "0.0-fake" and doc["layouts"] == ["tp"] and doc["dtype"] == "bfloat16"
    assert [(r["batch"], r["input_len"], r["output_len"]) for r in doc["rows"]] == [(2, 8, 3), (1, 4, 2)]
    for r in doc["rows"]:
        assert r["splash"]["tp"]["output_tokens_per_s"] > 0 and r["vllm"]["output_tokens_per_s"] > 0
        assert 0.0 <= r["agreement"]["tp"]["first_token"] <= 1.0


def test_serve_peer_end_to_end_with_a_stand_in(fake_venv, capsys, tmp_path):
    code, out, err = run_cli(capsys, "bench", "serve", "--model", "tiny", "--peer", "vllm", "--num-prompts",
                             "3", "--input-len", "8", "--output-len", "4", "--max-concurrency", "2",
                             "--disable-tqdm", "--json", "--startup-timeout", "240", "--peer-kv-gib", "0.02",
                             "--plot", str(tmp_path / "itl.png"))
    assert code == 0, err
    doc = json.loads(out)
    for side in ("splash", "vllm"):
        s = doc[side]
        assert s["completed"] == 3 and s["failed"] == 0 and s["total_output_tokens"] == 12
        # every delivery after each request's first: up to 3 per request; both servers are splash (the
        # stand-in execs `splash serve`), whose stream carries two tokens in one chunk when its reader
        # lags a step (steps of ~2 ms here, CI load)
        n = len(s["itl_timeline"])
        assert 1 <= n <= 3 * 3
        assert wait_gone(s["server_pid"], 30)  # stopped by its id once its load was done
    assert doc["splash"]["server_pid"] != doc["vllm"]["server_pid"]
    assert set(doc["ratios"]) == {"output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                                  "max_itl_ms"}
    for side in ("splash", "vllm"):
        # (the timeline is rounded to the microsecond, the maximum is not)
        assert doc[side]["max_itl_ms"] == pytest.approx(max(ms for _, ms in doc[side]["itl_timeline"]),
                                                        abs=1e-3)
    assert (tmp_path / "itl.png").stat().st_size > 1000


def test_serve_peer_rounds_alternate_and_report_median_ratios(fake_venv, capsys):
    """--rounds 2: splash, peer, splash, peer; every round's ratios kept, the reported ratio per metric
    is their median, and the table lists each round."""
    args = ("bench", "serve", "--model", "tiny", "--peer", "vllm", "--num-prompts", "2", "--input-len", "8",
            "--output-len", "3", "--max-concurrency", "2", "--disable-tqdm", "--startup-timeout", "240",
            "--rounds", "2", "--peer-kv-gib", "0.02")
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["rounds"]) == 2
    for m, r in doc["ratios"].items():
        each = [x["ratios"][m] for x in doc["rounds"]]
        assert r == pytest.approx(sum(each) / 2), m  # the median of two
        for x in doc["rounds"]:
            assert x["ratios"][m] == pytest.approx(x["splash"][m] / x["vllm"][m])
    assert doc["splash"]["output_throughput"] in [x["splash"]["output_throughput"] for x in doc["rounds"]]


def test_serve_peer_gives_splash_the_kv_bytes_the_peer_gets():
    """splash serve's pool in the side-by-side holds --peer-kv-gib per rank (vLLM's KV space), in pages
    of splash serve's size: a smaller default pool would preempt at high concurrency."""
    import argparse

    import torch

    from splash.core.model_config import ModelConfig
    from splash.kv.pool import KVPool
    from splash.model import resolve_model_path

    a = argparse.Namespace(model="tiny", dtype="bfloat16", num_prompts=4, max_concurrency=2, tp=1,
                           layout=None, api_key=None, peer_kv_gib=0.5)
    cmd = serve_peer.splash_command(a, 8123, "tiny")
    pages = int(cmd[cmd.index("--num-kv-pages") + 1])
    cfg = ModelConfig.from_hf(resolve_model_path("tiny"))
    per_page = KVPool.bytes_per_page(cfg, 16, torch.bfloat16)
    assert pages == (2**29) // per_page and pages * per_page <= 2**29 < (pages + 1) * per_page
