"""Sampling parameters (vLLM-style), validated up front so bad input fails before it is queued."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate (vLLM's `structured_outputs`; SGLang's `json_schema`,
    `regex`, `ebnf`; OpenAI's `response_format`), applied by a grammar matcher on rank 0
    (splash/engine/grammar.py). Exactly one kind: `json` (a JSON schema, dict or text), `json_object`
    (any JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF, xgrammar's dialect:
    GBNF-like) or `structural_tag` (xgrammar's structural-tag JSON: tool calls in a model's own format).
    `start_after`: token ids that must be generated first (a reasoning model's end-of-thinking): the
    constraint applies to what follows them, as both peers do."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in GUIDE_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, "
                             f"grammar or structural_tag; got {', '.join(set_) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c
                                                                    for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        for k in ("regex", "grammar", "structural_tag"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"{k} must be a non-empty string")
        object.__setattr__(self, "start_after", tuple(int(t) for t in self.start_after))

    @property
    def kind(self) -> str:
        return next(k for k in GUIDE_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the cache key): its kind and canonical text."""
        v = getattr(self, self.kind)
        if isinstance(v, dict):
            v = json.dumps(v, sort_keys=True)
        elif isinstance(v, tuple):
            v = json.dumps(list(v))
        return self.kind, str(v)


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
    # Both peers' sampling controls: penalties (vLLM's: repetition over prompt and output, presence and
    # frequency over the output), min_p (relative to the most likely token), OpenAI's logit_bias
    # ({token id: bias added to its logit}), and a stop string kept in the text.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

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
        if not number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            for t, b in self.logit_bias.items():
                if not integer(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
                if not number(b) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError("include_stop_str_in_output must be true or false")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
