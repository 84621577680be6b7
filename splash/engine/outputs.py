"""What the engine hands back for a request: vLLM-shaped output objects."""

from __future__ import annotations

from dataclasses import dataclass, field


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
