"""The raw Mooncake baseline of `splash bench serve --pd`: the engine's KV transfers against a bare
`batch_transfer_sync_write` of the same bytes in the same pieces, between two TransferEngine objects in two
processes on loopback (as a prefill and a decode are), nothing of splash around the call.

The pieces: splash writes one run of contiguous pages per (store, layer) (splash/disagg/transfer.py), so a
request of `pages` pages moves, per store and layer, one piece of `pages x page bytes` (its pages
contiguous on both sides; fragmented pages only add pieces, so this is the engine's best case and the
ratio against it is conservative). The receiver runs as `python -m splash.bench.pd_transfer receive N`:
it registers N bytes, prints one JSON line (its session and address) and waits for stdin to close.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any


def _stores(layout: dict[str, Any]) -> tuple[list[tuple[int, int]], int]:
    """The decode's published layout (`stores`: per store [layers, pages, page tokens, row...] and elem
    bytes) as (layers, bytes of one page of one layer) per store, and the bytes of one page in all."""
    stores = [(int(s["shape"][0]), math.prod(int(x) for x in s["shape"][2:]) * int(s["elem"]))
              for s in layout["stores"]]
    per_page = sum(n_layers * page for n_layers, page in stores)
    if per_page <= 0:
        raise ValueError("the layout lists no KV stores")
    return stores, per_page


def pieces(layout: dict[str, Any], bytes_per_transfer: float) -> list[int]:
    """The piece sizes of one transfer of `bytes_per_transfer` (the mean of the engine's): one run of
    pages per store and layer."""
    stores, per_page = _stores(layout)
    pages = max(1, round(bytes_per_transfer / per_page))
    return [pages * page for n_layers, page in stores for _ in range(n_layers)]


def _engine() -> Any:
    os.environ.setdefault("GLOG_minloglevel", "2")  # (Mooncake's glog INFO/WARNING lines on stderr)
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    rc = eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake's transfer engine did not start (code {rc})")
    return eng


def receive(nbytes: int) -> None:
    """The receiving side: register `nbytes`, say where, hold them until stdin closes."""
    import torch

    eng = _engine()
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    if eng.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError("registering the receive buffer failed")
    print(json.dumps({"session_id": f"127.0.0.1:{eng.get_rpc_port()}", "base": buf.data_ptr()}), flush=True)
    sys.stdin.read()
    eng.unregister_memory(buf.data_ptr())


def taskset(cmd: list[str], cores: Sequence[int] | None) -> list[str]:
    """`cmd` bound to `cores` (or as it is, floating)."""
    return ["taskset", "-c", ",".join(map(str, cores)), *cmd] if cores else cmd


@contextlib.contextmanager
def _pair(total: int, receiver_cores: list[int] | None = None) -> Iterator[tuple[Any, str, int, int]]:
    """A receiver process holding `total` bytes (on `receiver_cores`, or floating) and this process's
    engine with a registered send buffer of as many: (engine, peer session, send base, receive base)."""
    import torch

    cmd = [sys.executable, "-m", "splash.bench.pd_transfer", "receive", str(total)]
    proc = subprocess.Popen(taskset(cmd, receiver_cores),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise RuntimeError(f"the raw Mooncake receiver exited with {proc.wait(10)}")
        peer = json.loads(line)
        eng = _engine()
        src = torch.randint(0, 255, (total,), dtype=torch.uint8)
        if eng.register_memory(src.data_ptr(), total) != 0:
            raise RuntimeError("registering the send buffer failed")
        try:
            yield eng, peer["session_id"], src.data_ptr(), int(peer["base"])
        finally:
            eng.unregister_memory(src.data_ptr())
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _write(eng: Any, session: str, src: int, dst: int, sizes: list[int]) -> float:
    """One batch write of `sizes` (pieces laid end to end from both bases); its seconds."""
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    t0 = time.perf_counter()
    rc = eng.batch_transfer_sync_write(session, [src + o for o in offs], [dst + o for o in offs], list(sizes))
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"the raw Mooncake write failed (code {rc})")
    return dt


def raw_throughput(sizes: list[int], transfers: int, warmup: int = 2, busy_thread: bool = False
                   ) -> dict[str, Any]:
    """`transfers` batch writes of `sizes` (one piece each) to a receiver process; bytes/s of the calls.

    `busy_thread`: while another Python thread of this process runs (as a server's event loop does beside
    its engine thread). The call releases the GIL; taking it back waits for that thread to give it up, up
    to `sys.getswitchinterval()` (5 ms) per call, which small transfers feel."""
    import threading

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True) if busy_thread else None
    total = sum(sizes)
    seconds = 0.0
    try:
        with _pair(total) as (eng, session, src, dst):
            if spinner is not None:
                spinner.start()
            for i in range(warmup + transfers):
                dt = _write(eng, session, src, dst, sizes)
                if i >= warmup:
                    seconds += dt
    finally:
        stop.set()
        if spinner is not None and spinner.is_alive():
            spinner.join()
    return {"bytes": total * transfers, "transfers": transfers, "seconds": seconds,
            "bytes_per_s": total * transfers / seconds if seconds > 0 else 0.0}


def pieces_for_tokens(layout: dict[str, Any], tokens: int) -> list[int]:
    """The piece sizes of one transfer of a `tokens`-token prompt (its pages: ceil(tokens / page tokens))."""
    page_tokens = int(layout["stores"][0]["shape"][2])
    return pieces(layout, -(-tokens // page_tokens) * _stores(layout)[1])


def _under_load(plans: list[list[int]], gap_s: float, receiver_cores: list[int] | None = None) -> None:
    """The sending process of `RawUnderLoad`: the plans' transfers in turn, one each `gap_s`, until
    stdin closes; then one JSON line of what they moved and took."""
    import threading

    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    moved = n = 0
    seconds = 0.0
    with _pair(max(sum(p) for p in plans), receiver_cores) as (eng, session, src, dst):
        for p in plans:  # (warm-up: each plan once, untimed)
            _write(eng, session, src, dst, p)
        print("ready", flush=True)
        while not done.wait(gap_s):
            sizes = plans[n % len(plans)]
            seconds += _write(eng, session, src, dst, sizes)
            moved += sum(sizes)
            n += 1
    print(json.dumps({"bytes": moved, "transfers": n, "seconds": seconds,
                      "bytes_per_s": moved / seconds if seconds > 0 else 0.0}), flush=True)


class RawUnderLoad:
    """Raw Mooncake writes in two processes of their own *while* a load runs (the baseline under the same
    CPU contention as the engine's transfers: on 2 cores the receiving thread waits for a core as the
    decode's does). `plans`: the piece sizes of each transfer, taken in turn, one every `gap_s`; `cores`:
    the sender's and the receiver's (the prefill's and the decode's, as the servers are pinned), or
    floating. No Python thread of the sender competes for its GIL (unlike a server's engine thread)."""

    def __init__(self, plans: list[list[int]], gap_s: float = 0.05,
                 cores: Sequence[list[int]] | None = None) -> None:
        self.plans, self.gap_s, self.cores = plans, gap_s, cores
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RawUnderLoad:
        job = {"plans": self.plans, "gap_s": self.gap_s,
               "receiver_cores": self.cores[1] if self.cores else None}
        self.proc = subprocess.Popen(taskset([sys.executable, "-m", "splash.bench.pd_transfer", "load",
                                               json.dumps(job)], self.cores[0] if self.cores else None),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the raw Mooncake sender under load exited with {self.proc.wait(10)}")
        return self

    def result(self) -> dict[str, Any] | None:
        """Stop sending; what was sent meanwhile (None if the sender died: a failed write)."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.readline()
        self.proc.wait(30)
        return json.loads(out) if out.strip() else None

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":  # the receiving process, or the sender under load
    if len(sys.argv) == 3 and sys.argv[1] == "receive":
        receive(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "load":
        job = json.loads(sys.argv[2])
        _under_load(job["plans"], float(job["gap_s"]), job.get("receiver_cores"))
    else:
        sys.exit("usage: python -m splash.bench.pd_transfer receive NBYTES | load JOB_JSON")
