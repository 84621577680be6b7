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

import json
import math
import os
import subprocess
import sys
import time
from typing import Any


def pieces(layout: dict[str, Any], bytes_per_transfer: float) -> list[int]:
    """The piece sizes of one transfer of `bytes_per_transfer` (the mean of the engine's), from the
    decode's published layout (`stores`: per store [layers, pages, page tokens, row...] and elem bytes)."""
    stores = [(int(s["shape"][0]), math.prod(int(x) for x in s["shape"][2:]) * int(s["elem"]))
              for s in layout["stores"]]
    per_page = sum(n_layers * page for n_layers, page in stores)
    if per_page <= 0:
        raise ValueError("the layout lists no KV stores")
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


def raw_throughput(sizes: list[int], transfers: int, warmup: int = 2, busy_thread: bool = False
                   ) -> dict[str, Any]:
    """`transfers` batch writes of `sizes` (one piece each) to a receiver process; bytes/s of the calls.

    `busy_thread`: while another Python thread of this process runs (as a server's event loop does beside
    its engine thread). The call releases the GIL; taking it back waits for that thread to give it up, up
    to `sys.getswitchinterval()` (5 ms) per call, which small transfers feel."""
    import threading

    import torch

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True) if busy_thread else None

    total = sum(sizes)
    proc = subprocess.Popen([sys.executable, "-m", "splash.bench.pd_transfer", "receive", str(total)],
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
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        srcs = [src.data_ptr() + o for o in offs]
        dsts = [int(peer["base"]) + o for o in offs]
        seconds = 0.0
        if spinner is not None:
            spinner.start()
        for i in range(warmup + transfers):
            t0 = time.perf_counter()
            rc = eng.batch_transfer_sync_write(peer["session_id"], srcs, dsts, list(sizes))
            dt = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"the raw Mooncake write failed (code {rc})")
            if i >= warmup:
                seconds += dt
        eng.unregister_memory(src.data_ptr())
    finally:
        stop.set()
        if spinner is not None and spinner.is_alive():
            spinner.join()
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return {"bytes": total * transfers, "transfers": transfers, "seconds": seconds,
            "bytes_per_s": total * transfers / seconds if seconds > 0 else 0.0}


if __name__ == "__main__":  # the receiving process
    if len(sys.argv) != 3 or sys.argv[1] != "receive":
        sys.exit("usage: python -m splash.bench.pd_transfer receive NBYTES")
    receive(int(sys.argv[2]))
