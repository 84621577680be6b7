"""What the engine hands back for a request: vLLM-shaped output objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One of a request's `n` sequences; fields grow as tokens are generated."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # logprobs[i] maps token id -> logprob for the i-th generated token (chosen token + top-k).
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string / token id that ended it, if any
    # With SamplingParams.return_routed_experts, once finished: int32 [positions, moe_layers, k], the
    # expert ids each MoE layer chose for the token at each position fed to the model (prompt and
    # generated tokens; the last generated token is never fed), ids sorted per position.
    routed_experts: Any = None
    # With SamplingParams.return_top_p_token_ids: per generated token, the ids it was drawn from
    top_p_token_ids: list[list[int]] | None = None
    # Speculative decoding: verify steps it took part in (SGLang's meta_info `spec_verify_ct`)
    spec_verify_ct: int = 0


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A snapshot of a request (all `n` sequences); `finished` once every sequence has ended."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: per prompt position {token: logprob}, None at position 0 (and
    # before prompt_logprobs_start), as vLLM's
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache (vLLM's name)
