"""What a request asks to change in its logits before a token is drawn, batched over a step's rows: its
grammar's allowed set (structured outputs), min_tokens (no end yet), logit_bias, and the repetition,
presence and frequency penalties, in vLLM's order and with its definitions:

- repetition (over prompt and output tokens, CTRL's rule): a seen token's positive logit is divided by
  the penalty, a negative one multiplied;
- presence and frequency (over output tokens, OpenAI's rule): logit -= frequency * count + presence *
  (count > 0).

Only rows that ask pay for anything; a step with none returns the logits untouched. Rank 0 runs this
on the logits of the step's sampled rows, the same on every layout, so seeded sampling is identical
across layouts and switches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splash.engine.sampling import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    num_generated: int  # tokens this sequence already generated (for min_tokens)
    generator: torch.Generator | None = None
    guide: Any = None  # its grammar matcher (structured outputs; splash/engine/grammar.py), or None
    prompt_ids: Sequence[int] = ()  # (read only when a penalty asks: repetition sees prompt + output)
    output_ids: Sequence[int] = ()


def blocked_ids(row: SampleRow, eos_ids: Sequence[int]) -> list[int]:
    """Tokens that may not end the sequence yet (min_tokens): EOS and the stop token ids."""
    if row.num_generated >= row.params.min_tokens:
        return []
    ids = [] if row.params.ignore_eos else list(eos_ids)
    return ids + list(row.params.stop_token_ids)


def process(logits: torch.Tensor, rows: Sequence[SampleRow], eos_ids: Sequence[int],
            grammar: Any = None) -> torch.Tensor:
    """`logits` [n, V] with every row's requests applied (a new tensor when any row asks, else the same
    one). `grammar`: the engine's GrammarBackend (needed when a row has a guide)."""
    blocked = [blocked_ids(r, eos_ids) for r in rows]
    guided = [i for i, r in enumerate(rows) if r.guide is not None]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    penal = [i for i, r in enumerate(rows) if r.params.penalized]
    if not (any(blocked) or guided or biased or penal):
        return logits
    logits = logits.clone()
    V = logits.shape[1]
    if guided:
        t0 = time.perf_counter()
        bitmask = grammar.allocate(len(guided))
        live = [j for j, i in enumerate(guided) if rows[i].guide.fill(bitmask, j)]
        if live:
            grammar.apply(logits, bitmask[live], [guided[j] for j in live])
        grammar.seconds["mask"] += time.perf_counter() - t0
    for i, ids in enumerate(blocked):
        if ids:
            logits[i, [t for t in ids if 0 <= t < V]] = float("-inf")
    for i in biased:
        bias = rows[i].params.logit_bias or {}
        ids = [t for t in bias if 0 <= t < V]
        if ids:
            logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
    if penal:
        _penalize(logits, rows, penal)
    return logits


def _penalize(logits: torch.Tensor, rows: Sequence[SampleRow], idx: list[int]) -> None:
    """The three penalties for rows `idx`, in place: one [k, V] count of output tokens and one seen mask
    of prompt + output, built by scatters."""
    dev, V = logits.device, logits.shape[1]
    k = len(idx)
    counts = torch.zeros(k, V, dtype=logits.dtype, device=dev)
    seen = torch.zeros(k, V, dtype=torch.bool, device=dev)
    for j, i in enumerate(idx):
        out = torch.tensor([t for t in rows[i].output_ids if 0 <= t < V], dtype=torch.long, device=dev)
        if out.numel():
            counts[j].index_add_(0, out, torch.ones(out.numel(), dtype=logits.dtype, device=dev))
        if rows[i].params.repetition_penalty != 1.0:
            prompt = torch.tensor([t for t in rows[i].prompt_ids if 0 <= t < V], dtype=torch.long, device=dev)
            seen[j, prompt] = True
    seen |= counts > 0
    sub = logits.index_select(0, torch.tensor(idx, device=dev))

    def column(name: str) -> torch.Tensor:
        vals = [getattr(rows[i].params, name) for i in idx]
        return torch.tensor(vals, dtype=logits.dtype, device=dev)[:, None]

    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    present = (counts > 0).to(logits.dtype)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * present
    logits[idx] = sub


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (set -inf) tokens less likely than min_p times the most likely one; rows with min_p 0 keep
    everything (`scaled`: temperature-scaled logits [k, V], `min_p` [k])."""
    if not bool((min_p > 0).any()):
        return scaled
    probs = scaled.softmax(dim=-1)
    cut = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return scaled.masked_fill(probs < cut, float("-inf"))
