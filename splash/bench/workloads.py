"""Prefix-sharing workloads for `splash bench serve --workload grpo|multiturn` (the prefix cache's cases).

- `grpo`: an RL step's rollouts: `num_prompts // group_size` random prompts, each sent as `group_size`
  separate requests one after another (how slime and verl send a GRPO group), all at once.
- `multiturn`: conversations whose every turn resends the history: turn t's prompt is turn t-1's prompt
  plus `turn_len` new tokens, sent once turn t-1 has finished. (The load generator sees no token ids of
  the replies, so the history is the earlier prompts; the replies' pages are not what is reused.)

A workload is a list of conversations, each a list of prompts sent in order (a GRPO request is a
one-turn conversation), so one runner serves both, and the plain random workload too.
"""

from __future__ import annotations

import random

WORKLOADS = ("random", "grpo", "multiturn")


def conversations(workload: str, num_prompts: int, input_len: int, vocab: int, seed: int, *,
                  group_size: int = 8, turns: int = 4, turn_len: int = 64,
                  lens: list[int] | None = None) -> list[list[list[int]]]:
    """The prompts of `num_prompts` requests, grouped into conversations (sent one turn after another)."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    if workload == "random":
        return [[draw(n)] for n in (lens or [input_len] * num_prompts)]
    if workload == "grpo":
        if group_size < 1:
            raise ValueError(f"--group-size must be >= 1, got {group_size}")
        groups = max(1, num_prompts // group_size)
        out = []
        for _ in range(groups):
            p = draw(input_len)
            out += [[list(p)] for _ in range(group_size)]
        return out
    if workload == "multiturn":
        if turns < 1 or turn_len < 1:
            raise ValueError(f"--turns and --turn-len must be >= 1, got {turns} and {turn_len}")
        out = []
        for _ in range(max(1, num_prompts // turns)):
            conv, p = [], draw(input_len)
            for _ in range(turns):
                conv.append(list(p))
                p = p + draw(turn_len)
            out.append(conv)
        return out
    raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")


def cache_counters(metrics_text: str) -> dict[str, float]:
    """Prefix-cache queries/hits (tokens) and KV usage from a Prometheus page, splash's or vLLM's names."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            if name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
                key = name.removesuffix("_total")
                out[key] = out.get(key, 0.0) + s.value
            elif name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
                out["kv_usage"] = max(out.get("kv_usage", 0.0), s.value)
    return out
