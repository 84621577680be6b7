"""`make demo` / `splash demo`: a guided tour that runs the real commands and writes PNGs under out/.

Each stage runs `python -m splash ...` exactly as a user would type it, so the demo exercises the
same code paths as the CLI and stays honest about what works.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

OUT = "out"


def _banner(title: str) -> None:
    print(f"\n{'=' * 100}\n== {title}\n{'=' * 100}", flush=True)


def _splash(*args: str, check: bool = True) -> int:
    cmd = [sys.executable, "-m", "splash", *args]
    print("$ splash " + " ".join(args), flush=True)
    rc = subprocess.call(cmd)
    if check and rc != 0:
        raise SystemExit(f"demo: `splash {' '.join(args)}` failed with exit code {rc}")
    return rc


def _device(tp: int) -> list[str]:
    """`--device cpu` where NCCL could not give each of the `tp` ranks its own GPU (e.g. one GPU)."""
    import torch

    return [] if torch.cuda.device_count() >= tp else ["--device", "cpu"]


def stage_plan() -> None:
    _banner("1. Analytical core: which layout would DeepSeek-V3 run on 8 x H200, and a simulated RL rollout")
    _splash("plan", "weights", "--model", "deepseek-v3", "--ranks", "8", "--dtype", "bf16")
    _splash("plan", "advise", "--model", "deepseek-v3", "--gpu", "h200", "--ranks", "8",
            "--batch", "32", "--context", "65536")
    _splash("plan", "crossovers", "--scenario", "h200", "--plot", f"{OUT}/crossovers_h200.png")
    _splash("simulate", "rollout", "--model", "deepseek-v3", "--gpu", "h200", "--ranks", "8",
            "--plot", f"{OUT}/rollout_sim_h200.png")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"demo: the server exited early with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"demo: the server did not become healthy within {timeout_s:.0f} s")


def stage_serve(tp: int = 1, layout: str | None = None) -> None:
    what = f"T={tp}" + (f", layout {layout}" if layout else "")
    _banner(f"2. The tiny model behind an OpenAI-compatible server ({what}), the official openai client")
    from openai import OpenAI

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", "tiny", "--port", str(port), "--tp", str(tp), *_device(tp)]
    if layout:
        args += ["--layout", layout]
    print("$ splash " + " ".join(args), flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "splash", *args])
    try:
        _wait_healthy(url, proc)
        client = OpenAI(base_url=f"{url}/v1", api_key="demo")
        done = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24,
                                         temperature=0)
        print(f"completion : {done.choices[0].text!r}  ({done.usage.completion_tokens} tokens)")
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me about attention layouts."}],
            max_tokens=24, temperature=0)
        print(f"chat       : {chat.choices[0].message.content!r}")
        print("streamed   : ", end="", flush=True)
        stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24,
                                           temperature=0.8, seed=7, stream=True)
        for chunk in stream:
            print(chunk.choices[0].text if chunk.choices else "", end="", flush=True)
        print()
        _splash("bench", "serve", "--base-url", url, "--num-prompts", "16", "--input-len", "64",
                "--output-len", "32", "--max-concurrency", "8")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(f"server shut down cleanly (exit code {proc.returncode})")


def stage_sweep() -> None:
    _banner("3. The four layouts on 2 ranks: throughput over input lengths x batch sizes (Figure 4 protocol)")
    _splash("bench", "sweep", "--model", "tiny", "--tp", "2", *_device(2), "--input-lens", "32,256",
            "--batch-sizes", "1,8,32", "--output-len", "16", "--memory-per-rank", "21MiB", "--no-progress",
            "--plot", f"{OUT}/sweep_tiny_t2.png")


def stage_rollout() -> None:
    _banner("4. Live switching: an RL-rollout batch on 2 ranks, fixed layouts vs `auto`")
    _splash("bench", "rollout", "--tp", "2", *_device(2), "--plot", f"{OUT}/rollout_tiny_t2.png")


STAGES: dict[str, Callable[[], None]] = {
    "plan": stage_plan,
    "serve": lambda: stage_serve(2, "dop"),  # rank 0 serves, rank 1 is a spawned worker
    "sweep": stage_sweep,
    "rollout": stage_rollout,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splash demo", description=__doc__)
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of: {', '.join(STAGES)}")
    args = parser.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    t0 = time.monotonic()
    for name in chosen:
        STAGES[name]()
    pngs = sorted(f for f in os.listdir(OUT) if f.endswith(".png"))
    _banner(f"demo finished in {time.monotonic() - t0:.0f} s; plots in {OUT}/: {', '.join(pngs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
