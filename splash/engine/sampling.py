"""Sampling parameters (vLLM-style), validated up front so bad input fails before it is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0 = only the chosen)
    skip_special_tokens: bool = True
    return_routed_experts: bool = False  # MoE expert ids per token and layer (RL routing replay)
    # Logprobs of each prompt token given the ones before it (vLLM's `prompt_logprobs`: the number of top
    # logprobs per position, 0 = only the prompt token's), from position `prompt_logprobs_start` on
    # (SGLang's `logprob_start_len`); position 0 has none. Costs nothing for requests that do not ask.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    # Logprobs of the distribution drawn from (temperature and min_tokens applied: SGLang's /generate)
    # instead of the raw logits (vLLM's default).
    logprob_temperature: bool = False
    # The kept set (top-k/top-p) of each draw, and logprobs renormalised over it (slime's top-p replay,
    # SGLang's custom_params.return_top_p_token_ids); needs a filter unless greedy.
    return_top_p_token_ids: bool = False

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether the request needs every prompt position computed (its prompt logprobs, or the experts
        each prompt token routed to), so the prefix cache must not skip any: it computes its whole
        prompt (its pages are still offered to the cache for others)."""
        return self.prompt_logprobs is not None or self.return_routed_experts

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field and the accepted range (bools are not numbers here)."""
        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v: object) -> bool:
            return (integer(v) or isinstance(v, float)) and math.isfinite(v)  # type: ignore[arg-type]

        if not integer(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not integer(self.seed) or not -2**63 <= self.seed < 2**63 - 2**16):
            raise ValueError(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        if self.max_tokens is not None and (not integer(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not integer(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not integer(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if not integer(self.prompt_logprobs_start) or self.prompt_logprobs_start < 0:
            raise ValueError(f"prompt_logprobs_start must be an integer >= 0, got "
                             f"{self.prompt_logprobs_start!r}")
        for name in ("ignore_eos", "skip_special_tokens", "return_routed_experts", "logprob_temperature",
                     "return_top_p_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.return_top_p_token_ids and not self.greedy and self.top_p == 1 and self.top_k <= 0:
            raise ValueError("return_top_p_token_ids needs top_p < 1 or top_k > 0 (or greedy): without a "
                             "filter every token of the vocabulary is kept")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
