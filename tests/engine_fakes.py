"""Model-free stand-ins for engine tests: a runner whose next token is a function of the history it
saw through the plans (so wrong positions, lost history or bad recompute change the output), and a
byte-level toy tokenizer."""

from __future__ import annotations

import torch

from splash.engine.plan import StepPlan

VOCAB = 138
EOS = 1


def next_token(history: list[int]) -> int:
    h = 7
    for t in history:
        h = (h * 31 + t) % 1000003
    return h % (VOCAB - 10) + 10


class FakeRunner:
    """Keeps each sequence's tokens as written by the plans; logits peak at `next_token(history)`."""

    def __init__(self, rule=next_token, fail_at_step: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.rule = rule
        self.cache: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []
        self.fail_at_step = fail_at_step

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.fail_at_step is not None and plan.step >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        self.plans.append(plan)
        rows, r = [], 0
        for sl in plan.seqs:
            hist = self.cache.setdefault(sl.req_id, [])
            del hist[sl.start:]  # recompute after preemption rewrites from `start`
            assert len(hist) == sl.start, "plan skipped positions"
            hist.extend(plan.input_ids[r:r + sl.num_new])
            r += sl.num_new
            if sl.sample:
                logits = torch.linspace(0, 1, VOCAB, dtype=torch.float64)
                logits[self.rule(hist)] = 8.0
                rows.append(logits)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB, dtype=torch.float64)


class ByteTok:
    """id = byte + 10; ids < 10 are special (skipped in decode)."""

    vocab_size = VOCAB + 256

    def encode(self, text: str) -> list[int]:
        return [b + 10 for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - 10 for i in ids if i >= 10).decode("utf-8", errors="replace")
