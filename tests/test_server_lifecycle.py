"""How `splash serve` ends: a server whose rank group dies says so and exits non-zero (as vLLM's does),
instead of answering /health 200 and a 500 per request for ever; on SIGTERM, a response still open when
--graceful-timeout runs out ends with an error event and [DONE], not cut mid-way."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_utils import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _workers(pid: int) -> list[int]:
    """The spawned rank processes of `pid` (its multiprocessing children other than the tracker)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(int(d.name))
    return out


def _health_until_exit(srv: ServeProcess, seconds: float) -> list[int]:
    """/health's answers, polled until the server exits (or `seconds` pass)."""
    health: list[int] = []
    deadline = time.monotonic() + seconds
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            health.append(httpx.get(srv.url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass  # already stopped listening
        time.sleep(0.1)
    return health


def test_killed_rank_makes_health_503_and_the_server_exit_1():
    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--tp", "2", "--layout", "dop",
                        "--max-model-len", "512", "--collective-timeout", "20"])
    try:
        workers = _workers(srv.proc.pid)
        assert len(workers) == 1, f"expected one spawned rank, found {workers}"
        events: list[str] = []

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not any(e.startswith("data: {") for e in events) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events, "the stream never started"
        os.kill(workers[0], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the stream did not end after its rank died"
        assert any('"error"' in e for e in events) and events[-1] == "data: [DONE]", events[-3:]
        health = _health_until_exit(srv, 30)
        assert srv.proc.wait(30) == 1, srv.output()
        assert 200 not in health, f"/health answered {health} after the rank group died"
        assert "the engine died" in srv.output()
    finally:
        srv.close()


def test_rank_dying_while_idle_is_noticed_without_a_request():
    """A worker killed while nothing runs (e.g. the OOM killer): the next /health, or the watchdog,
    sees it; the server does not wait for a request to fail first."""
    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--tp", "2", "--layout", "tp",
                        "--max-model-len", "256"])
    try:
        [worker] = _workers(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        health = _health_until_exit(srv, 20)
        assert srv.proc.wait(30) == 1, srv.output()
        assert health.count(200) <= 2, health  # (the first poll may come before the kill lands)
        assert "the engine died" in srv.output()
    finally:
        srv.close()


def test_sigterm_ends_a_long_stream_cleanly_after_the_grace_period():
    srv = ServeProcess(["--model", "tiny", "--dtype", "float32", "--max-model-len", "4096",
                        "--graceful-timeout", "2"])
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        events: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            events.append(next(lines))
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            events += list(lines)
            took = time.monotonic() - t0
        assert events[-1] == "data: [DONE]", events[-3:]
        err = json.loads(events[-2].removeprefix("data: "))
        assert "shutting down" in err["error"]["message"], err
        assert took < 10, f"the stream took {took:.1f} s to end after SIGTERM"
        assert srv.proc.wait(30) == 0, srv.output()
        assert "Exception in ASGI application" not in srv.output() and "CancelledError" not in srv.output()
    finally:
        srv.close()
