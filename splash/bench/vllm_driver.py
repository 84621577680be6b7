"""The peer side of `splash bench offline --peer vllm`: a script run by `.venv-vllm/bin/python`.

Standalone on purpose (stdlib + vLLM, never splash: the peer venv does not hold splash's dependencies).
`python vllm_driver.py JOB.json RESULT.json`: JOB names the checkpoint, dtype, tensor_parallel_size,
repeat and a list of shapes (the exact prompt token ids and new-token count of each); RESULT holds, per
shape, the fastest of `repeat` timed `generate` calls (after a warm-up call of the same batch) and the
generated token ids of the last call. Greedy, `ignore_eos`, token ids in and out (no tokenizer).
The `__main__` guard is required: vLLM's CPU engine spawns processes that re-import this file.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype=job.get("dtype", "bfloat16"),
              tensor_parallel_size=int(job.get("tp", 1)), max_model_len=job.get("max_model_len"),
              max_num_seqs=max(len(s["prompts"]) for s in job["shapes"]), seed=0)
    load_s = time.perf_counter() - t0
    out = {"load_seconds": load_s, "shapes": []}
    for shape in job["shapes"]:
        prompts = [{"prompt_token_ids": list(p)} for p in shape["prompts"]]
        warm = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)
        llm.generate(prompts, warm, use_tqdm=False)
        params = SamplingParams(max_tokens=int(shape["output_len"]), temperature=0.0, detokenize=False,
                                ignore_eos=True)
        best, outs = float("inf"), []
        for _ in range(int(job.get("repeat", 1))):
            reset = getattr(llm, "reset_prefix_cache", None)  # where its cache is on, time prefill as
            if reset is not None:                             # splash's side does (older vLLM: no cache)
                reset()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        out["shapes"].append({"seconds": best, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    try:
        import vllm

        out["version"] = vllm.__version__
    except Exception:  # noqa: BLE001 (a version string is a nicety)
        pass
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_driver.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    result = run(job)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
