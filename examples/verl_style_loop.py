"""A verl-style RL loop in one process: the trainer holds `splash.Engine` (SGLang's `Engine` shape) and
calls its methods, no server in between.

    python examples/verl_style_loop.py --steps 2            # the built-in tiny model, one rank
    python examples/verl_style_loop.py --tp 2 --layout auto  # two ranks, the layout policy on

Each step, as verl's hybrid engine does it: (1) rollout - `generate` with token ids, a sampling_params
dict and logprobs, n samples per prompt; (2) the engine's memory is released for training
(`release_memory_occupation`; splash frees the KV pool and weight buffers on every rank), a stand-in
update (a group-normalised advantage scales a perturbation of a few weights) runs, and the memory comes
back (`resume_memory_occupation`); (3) the new weights go in with `update_weights_from_tensor` (all or
nothing, in whatever layout runs) and `flush_cache`; the next rollout carries the new weight version.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

from splash import Engine
from splash.model.tiny import BUILTIN_MODELS, ensure_builtin_model


def reward(ids: list[int]) -> float:
    """A stand-in verifier: the share of even token ids."""
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layout", default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    args = ap.parse_args()
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], list(range(40, 52))]
    sampling = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "n": args.n}
    kw = {"layout": args.layout} if args.layout else {}
    with Engine(model_path=args.model, tp_size=args.tp, enable_memory_saver=True, device="cpu",
                dtype="float32", num_kv_pages=256, **kw) as engine:
        # the trainer's own copy of the weights it trains (here: two tensors read from the checkpoint)
        path = Path(ensure_builtin_model(args.model) if args.model in BUILTIN_MODELS else args.model)
        names = ["model.norm.weight", "lm_head.weight"]
        policy = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                policy.update({n: st.get_tensor(n).float() for n in names if n in st.keys()})
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True)
            rewards = [reward(o["output_ids"]) for o in outs]
            logps = [sum(x[0] for x in o["meta_info"]["output_token_logprobs"]) for o in outs]
            mean, sd = statistics.mean(rewards), statistics.pstdev(rewards) or 1.0
            adv = [(r - mean) / sd for r in rewards]
            print(f"step {step}: {len(outs)} samples, reward {mean:.3f}, mean logp "
                  f"{statistics.mean(logps):.2f}, weights {outs[0]['meta_info']['weight_version']}, "
                  f"{time.perf_counter() - t0:.2f}s")
            assert engine.release_memory_occupation()["success"]  # the trainer has the memory now
            scale = statistics.mean(a * lp for a, lp in zip(adv, logps))  # a policy-gradient-shaped scalar
            g = torch.Generator().manual_seed(step)
            for t in policy.values():  # the stand-in training step
                t.add_(1e-4 * scale * torch.randn(t.shape, generator=g, dtype=t.dtype))
            assert engine.resume_memory_occupation()["success"]
            got = engine.update_weights_from_tensor(list(policy.items()), weight_version=f"step-{step}")
            assert got["success"], got["message"]
            assert engine.flush_cache()["success"]
        info = engine.get_server_info()
        print("server info:", {k: info[k] for k in ("tp_size", "layout", "weight_version")})


if __name__ == "__main__":
    main()
