"""The offline benchmarks' workload and their check on it: random-token prompts, and how far two runs'
greedy tokens agree (splash/bench/offline.py and its --peer vllm run, splash/bench/offline_peer.py)."""

from __future__ import annotations

import random
from typing import Any


def random_prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `input_len` token ids drawn uniformly below `vocab` (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence generated identically before the first divergence."""
    fr = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fr.append(k / max(1, len(x)))
    return sum(fr) / max(1, len(fr))


def best_run(repeat: int, run: Any, key: str = "tok_per_s") -> dict[str, Any]:
    """The fastest (largest `key`) of `repeat` calls of `run()` (each a dict of figures)."""
    best: dict[str, Any] | None = None
    for _ in range(repeat):
        r = run()
        if best is None or r[key] > best[key]:
            best = r
    assert best is not None
    return best
