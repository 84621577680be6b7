"""The peer engine for side-by-side benchmarks: vLLM's CPU engine in its own venv (`make peer-venv`).

What every `--peer vllm` benchmark needs around it: where the venv is (and a one-line error when it is
not there), the environment its CPU engine wants, and a child process that is always stopped by its
process id (its whole process group: vLLM's server spawns an engine-core process), on success, on error
and on Ctrl-C. Nothing here imports vLLM: it only ever runs in the peer venv's interpreter.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import IO

from splash.core.model_config import ConfigError
from splash.env import text as env_text

PEERS = ("vllm",)
VENV_DIR = ".venv-vllm"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


class PeerMissing(ConfigError):
    """The peer's venv is not there; the message says how to make it."""


def peer_python(venv: str | None = None) -> str:
    """The peer venv's interpreter: `venv` (or $SPLASH_PEER_VENV), else .venv-vllm in the repo root or the
    working directory."""
    given = venv or env_text("SPLASH_PEER_VENV")
    places = [given] if given else [os.path.join(ROOT, VENV_DIR), os.path.abspath(VENV_DIR)]
    for place in dict.fromkeys(places):
        py = os.path.join(place, "bin", "python")
        if os.path.isfile(py) and os.access(py, os.X_OK):
            return py
    raise PeerMissing(f"vLLM's venv is missing (looked for {' and '.join(dict.fromkeys(places))}): "
                      "run make peer-venv")


def peer_env(tp: int = 1, kv_gib: float = 2.0, cores: int | None = None, python: str | None = None
             ) -> dict[str, str]:
    """The environment vLLM's CPU engine wants: KV space in GiB, the cores its OpenMP threads bind to
    (VLLM_CPU_OMP_THREADS_BIND already in the environment wins) and, as vLLM's CPU guide advises, Intel's
    OpenMP runtime preloaded when the venv of `python` ships it (10-20% faster here; an LD_PRELOAD
    already set wins)."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_gib:g}"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", thread_binding(tp, cores))
    iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so") if python else ""
    if iomp and os.path.isfile(iomp) and not env.get("LD_PRELOAD"):
        env["LD_PRELOAD"] = iomp
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.pop("PYTHONPATH", None)  # splash's path must not shadow the peer venv's packages
    return env


def thread_binding(tp: int, cores: int | None = None) -> str:
    """Every allowed core, split into `tp` equal groups ("0-1" for one rank on 2 cores, "0|1" for two).

    Never `auto`: on this machine it keeps one of the two cores for vLLM's front-end process, so its
    model would compute on one core while splash's uses both (and with T ranks it refuses outright:
    "Not enough allowed NUMA nodes")."""
    allowed = list(range(cores)) if cores is not None else sorted(os.sched_getaffinity(0))
    if len(allowed) < tp:
        raise ConfigError(f"--tp {tp} for the peer needs at least {tp} cores; there are {len(allowed)}")
    per = len(allowed) // tp
    return "|".join(_id_list(allowed[r * per:(r + 1) * per]) for r in range(tp))


def _id_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's CPU id list syntax)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeerProcess:
    """A child process in its own process group, logged to a file, stopped by its process id.

    Use as a context manager: leaving the block (normally, on an exception, on KeyboardInterrupt) sends
    SIGTERM to the group, waits `grace_s`, then SIGKILLs what is left."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, name: str = "peer",
                 grace_s: float = 20.0, log_path: str | None = None) -> None:
        self.name, self.grace_s = name, grace_s
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"splash-{name.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(list(cmd), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        """The exit status; TimeoutError (the process is left to stop()) if it runs past `timeout`."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} ran past {timeout:.0f} s (log: {self.log_path})") from None

    def stop(self) -> int | None:
        """SIGTERM the process group by the child's id, SIGKILL after the grace period; idempotent."""
        if self.proc.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        _signal_group(self.pid, signal.SIGKILL)  # stragglers of the group (an engine core) go too
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def failure(self) -> str:
        """One line saying why the child failed: the last error-looking line of its log."""
        lines = [ln.strip() for ln in self.tail(20000).splitlines() if ln.strip()]
        hits = [ln for ln in lines if "Error" in ln or "error:" in ln]
        last = (hits or lines or ["(no output)"])[-1]
        return f"{self.name} failed: {last[-300:]} (log: {self.log_path})"


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group the child leads (start_new_session): its id is the child's id
    except (ProcessLookupError, PermissionError):
        pass


def wait_until(ready: Callable[[], bool], proc: PeerProcess, timeout: float, what: str,
               interval: float = 0.5) -> float:
    """Poll `ready()` until true; fail at once if the process exits, or after `timeout` seconds.
    Returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(proc.failure())
        try:
            if ready():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 (not up yet: connection refused, 503, ...)
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} was not ready after {timeout:.0f} s (log: {proc.log_path})")
        time.sleep(interval)
