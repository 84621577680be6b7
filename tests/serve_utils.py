"""Start and stop a real `splash serve` subprocess on loopback for tests (bounded waits everywhere)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackProcess:
    """A server subprocess on a free loopback port, its output in a log file kept for failure messages;
    the constructor returns once `ready()` is true (a bounded wait: it raises with the log on exit or
    timeout)."""

    name = "process"
    tail = 5000  # characters of the log a failure message shows

    def __init__(self, cmd: list[str], env: dict[str, str], startup_timeout: float) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{self.name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"{self.name} not ready after {startup_timeout}s:\n{self.output()}")
            try:
                if self.ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def ready(self) -> bool:
        raise NotImplementedError

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-self.tail:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig`, wait up to `timeout`, then kill; return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        Path(self.log.name).unlink(missing_ok=True)


class ServeProcess(LoopbackProcess):
    """`python -m splash serve ARGS --port P`; `url` is ready once `/health` answered 200."""

    name = "splash-serve"

    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "splash", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        super().__init__(cmd, env, startup_timeout)

    def ready(self) -> bool:
        return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
