"""The CPU kernels' C libraries: each built once per machine with the system C compiler, loaded with
ctypes, no torch headers and no build step at install time (attention/native.py: paged attention and the
DSA index top-k; model/gemm.py: the few-row bf16 products).

A library is compiled on first use (about a second) into the splash cache folder, keyed by its source
(and the headers beside it), the flags and the CPU (`-march=native`: never a flag assumed at build time),
and shared by every process. A machine without a C compiler, or a build that fails, gets the torch path
with one warning. CUDA never uses these.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

from splash import env

log = logging.getLogger("splash.kernels")

FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared",
         "-fno-math-errno"]


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha1(line.encode()).hexdigest()[:8]
    except OSError:
        pass
    return platform.machine()


def _build(target: str, src: str) -> None:
    cc = env.text("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent builders each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class Library:
    """One C source's library: built on first use into the splash cache folder as
    `<name>-<sha1(source + headers + flags)>-<cpu>.so` (shared by every process), loaded once per
    process; every function returns an int (0 = done) and takes `argtypes` (one list for all, or a list
    per function name)."""

    def __init__(self, src: str, funcs: list[str], argtypes: list | dict[str, list], what: str) -> None:
        self.src, self.funcs, self.argtypes, self.what = src, funcs, argtypes, what
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self.lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        """The loaded library (built first if this machine has none yet); None where it cannot be."""
        if self.tried:
            return self.lib
        with self.lock:
            if self.tried:
                return self.lib
            self.tried = True
            from splash.model.tiny import cache_dir

            h = hashlib.sha1(" ".join(FLAGS).encode())
            headers = sorted(glob.glob(os.path.join(os.path.dirname(self.src), "*.h")))
            for path in [self.src, *headers]:  # (the headers it may include)
                with open(path, "rb") as f:
                    h.update(f.read())
            tag = h.hexdigest()[:12]
            name = os.path.splitext(os.path.basename(self.src))[0]
            target = os.path.join(cache_dir(), "kernels", f"{name}-{tag}-{_cpu_tag()}.so")
            try:
                if not os.path.isfile(target):
                    _build(target, self.src)
                lib = ctypes.CDLL(target)
                for fname in self.funcs:
                    fn = getattr(lib, fname)
                    fn.restype = ctypes.c_int
                    fn.argtypes = self.argtypes[fname] if isinstance(self.argtypes, dict) else self.argtypes
                self.lib = lib
            except Exception as e:  # no compiler, a failed build, a library that will not load
                log.warning("native CPU %s unavailable (%s); using the torch path", self.what, e)
                self.lib = None
        return self.lib
