"""A GRPO-shaped RL loop against a running `splash serve`, the way slime drives SGLang.

Start the server (2 ranks, the layout policy on, switch decisions in the log), then the loop:

    splash serve --model tiny --tp 2 --layout auto --num-kv-pages 40 --log-level info --port 8000 &
    python examples/rl_rollout.py --url http://127.0.0.1:8000 --model tiny --steps 3

Each step: (1) rollout - every prompt sampled `n` times through the native `/generate` with token ids
and per-token logprobs, one batch that the server drains to completion (its layout follows the drain:
wide while many requests run, narrow in the tail); (2) a stand-in "training" step in this process (the
trainer): a group-normalised advantage per sample (GRPO) scales a random perturbation of a few weight
tensors; (3) the new tensors are pushed to every engine rank over `update_weights_from_distributed`
(this process is rank 0 of a gloo group it shares with the engine's ranks), with a new
`weight_version` that the next rollout's responses carry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import httpx
import torch


def call(client: httpx.Client, path: str, body: dict[str, Any] | None = None, get: bool = False) -> Any:
    r = client.get(path) if get else client.post(path, json=body or {})
    if r.status_code != 200:
        raise SystemExit(f"{path}: HTTP {r.status_code}: {r.text}")
    return r.json()


def reward(ids: list[int]) -> float:
    """A stand-in verifier: the share of even token ids (anything cheap and deterministic will do)."""
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


def rollout(client: httpx.Client, prompts: list[list[int]], n: int, max_new: int) -> list[dict[str, Any]]:
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"n": n, "max_new_tokens": max_new, "temperature": 1.0}}
    return call(client, "/generate", body)


def train_step(weights: dict[str, torch.Tensor], names: list[str], samples: list[dict[str, Any]], n: int,
               lr: float, gen: torch.Generator) -> float:
    """GRPO's advantage (reward minus its group's mean, over its group's std) scales a perturbation of
    `names` in place: a stand-in for a real optimiser step. Returns the mean reward."""
    rewards = [reward(s["output_ids"]) for s in samples]
    adv = []
    for g in range(0, len(rewards), n):
        grp = rewards[g:g + n]
        mu, sd = statistics.fmean(grp), statistics.pstdev(grp) or 1.0
        adv += [(r - mu) / sd for r in grp]
    scale = lr * (1.0 + statistics.fmean(abs(a) for a in adv))
    for name in names:
        w = weights[name]
        w.add_(torch.randn(w.shape, generator=gen, dtype=w.dtype) * scale * w.std())
    return statistics.fmean(rewards)


def push(client: httpx.Client, group: Any, weights: dict[str, torch.Tensor], names: list[str],
         version: str) -> dict[str, Any]:
    """POST the update (the server then waits for the tensors) while broadcasting them from rank 0."""
    body = {"names": names, "dtypes": [str(weights[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(weights[n].shape) for n in names], "group_name": "rl", "weight_version": version}
    reply: dict[str, Any] = {}
    t = threading.Thread(target=lambda: reply.update(call(client, "/update_weights_from_distributed", body)))
    t.start()
    for n in names:
        group.broadcast(weights[n].contiguous(), src=0)
    t.join()
    return reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny", help="the checkpoint the server serves (the trainer's start)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO's group)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--port", type=int, default=0, help="the weight-update group's port (0: a free one)")
    args = ap.parse_args()

    from splash.distributed.launch import free_port
    from splash.distributed.weight_group import join_group
    from splash.model import resolve_model_path
    from splash.model.loader import CheckpointReader

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=args.url, headers=headers, timeout=600)
    info = call(client, "/get_server_info", get=True)
    ranks = int(info["tp_size"])
    print(f"server: {info['model']} on {ranks} ranks, layout {info['layout']} ({info.get('layout_mode')}), "
          f"weights {info['weight_version']}")

    # The trainer's copy of the weights: the checkpoint the server started from, in the server's dtype.
    dtype = getattr(torch, info["dtype"])
    reader = CheckpointReader(resolve_model_path(args.model))
    weights = {n: reader.get(n, dtype) for n in reader.keys() if not n.endswith("_scale_inv")}
    reader.close()
    trained = sorted(n for n in weights if n.endswith(("q_b_proj.weight", "o_proj.weight"))
                     or n == "lm_head.weight")

    port = args.port or free_port()
    world = 1 + ranks
    holder: dict[str, Any] = {}
    joiner = threading.Thread(target=lambda: holder.update(g=join_group("127.0.0.1", port, 0, world, "rl")))
    joiner.start()  # the server's ranks join while we wait for them
    call(client, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                               "rank_offset": 1, "world_size": world, "group_name": "rl",
                                               "backend": "gloo"})
    joiner.join()
    group = holder["g"]

    gen = torch.Generator().manual_seed(0)
    prompts = [[(7 * i + 3 * j) % 200 + 20 for j in range(8 + i % 5)] for i in range(args.prompts)]
    seen: dict[str, int] = dict(info.get("switches_total", {}))
    try:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            samples = rollout(client, prompts, args.n, args.max_new_tokens)
            t_roll = time.perf_counter() - t0
            versions = {s["meta_info"]["weight_version"] for s in samples}
            toks = sum(s["meta_info"]["completion_tokens"] for s in samples)
            mean_lp = statistics.fmean(lp[0] for s in samples
                                       for lp in s["meta_info"]["output_token_logprobs"])
            st = call(client, "/get_server_info", get=True)
            now = dict(st.get("switches_total", {}))
            during = {k: v - seen.get(k, 0) for k, v in now.items() if v > seen.get(k, 0)}
            seen = now
            r = train_step(weights, trained, samples, args.n, args.lr, gen)
            t1 = time.perf_counter()
            reply = push(client, group, weights, trained, f"step-{step}")
            t_push = time.perf_counter() - t1
            print(f"step {step}: rollout {len(samples)} samples, {toks} tokens in {t_roll:.2f} s "
                  f"(weights {','.join(sorted(versions))}), mean logprob {mean_lp:.3f}, reward {r:.3f}; "
                  f"switches in this drain {json.dumps(during)}, layout now {st['layout']}; "
                  f"pushed {len(trained)} tensors in {t_push:.2f} s -> {reply['weight_version']}")
        check = call(client, "/get_weight_version", get=True)["weight_version"]
        print(f"done: the server serves weight version {check}")
    finally:
        call(client, "/destroy_weights_update_group", {"group_name": "rl"})
        group.close()


if __name__ == "__main__":
    main()
