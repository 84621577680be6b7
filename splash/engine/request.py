"""A request (what the user asked for) and its sequences (what the scheduler runs).

A request with `n > 1` becomes `n` independent sequences that share the prompt: each prefills on
its own (no prefix sharing yet), so the scheduler only ever sees single sequences.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splash.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from splash.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from splash.engine.detokenizer import IncrementalDetokenizer

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its KV was dropped and will be recomputed)
    RUNNING = "running"  # holds pages; prefilling in chunks or decoding
    FINISHED = "finished"

    @property
    def done(self) -> bool:
        return self is SeqStatus.FINISHED


@dataclass(eq=False)
class Sequence:
    """One generated sequence: its tokens, KV page table and progress through the cache."""

    group: Request
    index: int  # position among the request's n sequences
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    pages: list[list[int]] = field(default_factory=list)  # pages[r][j], see docs/runtime.md
    owner: int = 0
    slot: int = -1  # KDA models: its state slot while admitted (splash/kv/state.py), else -1
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    num_preemptions: int = 0
    prompt_high: int = 0  # prompt tokens computed at least once (for the prompt-token counter)
    routing: list[tuple[int, Any]] | None = None  # (start position, expert ids [n, layers, k]) chunks
    top_p_ids: list[list[int]] | None = None  # per generated token, the kept set it was drawn from
    # prefix cache (splash/kv/prefix.py): chain keys of its full pages so far, the block (or None: a
    # private page) behind each of its first pages, and the prompt tokens its last admission reused
    block_keys: list[bytes] = field(default_factory=list)
    cached_blocks: list[Any] = field(default_factory=list)
    num_cached_tokens: int = 0
    cache_epoch: int = 0  # the prefix cache's epoch at admission: it registers pages only in that one
    guide: Any = None  # structured outputs: its grammar matcher (splash/engine/grammar.py), else None
    draft: list[int] = field(default_factory=list)  # drafts the step being run verifies (spec.py)
    next_draft: list[int] = field(default_factory=list)  # MTP drafts for its next step (engine/mtp.py)
    spec_verify_ct: int = 0  # verify steps it took part in (SGLang's meta_info name)
    spec_accepted: int = 0  # drafts accepted in them
    spec_rejected: int = 0  # verifies that stopped at a rejected draft (the depth policy's estimate)

    def keep_routing(self, start: int, ids: Any) -> None:
        """Routed experts of positions start.. (a recompute after preemption replaces later ones)."""
        if self.routing and self.routing[-1][0] + len(self.routing[-1][1]) == start:
            self.routing.append((start, ids))  # the usual case: the next positions, in order
            return
        chunks = [(s, c[:max(0, start - s)]) for s, c in (self.routing or []) if s < start]
        self.routing = [x for x in chunks if len(x[1])] + [(start, ids)]

    def routed_experts(self) -> Any:
        if not self.routing:
            return None
        import torch

        return torch.cat([c for _, c in self.routing])

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.group.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def num_tokens(self) -> int:
        return len(self.group.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt ++ output, without copying the whole list."""
        p = self.group.prompt_token_ids
        n = len(p)
        if stop <= n:
            return p[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return p[start:] + self.output_token_ids[:stop - n]

    @property
    def is_prefill(self) -> bool:
        """Still filling the cache with known tokens (prompt, or prompt+output after preemption)."""
        return self.num_tokens - self.num_computed > 1

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def completion(self) -> CompletionOutput:
        """A snapshot for the user (lists copied so later steps do not mutate it)."""
        text = self.detok.visible_text(self.status.done) if self.detok else ""
        return CompletionOutput(
            index=self.index,
            token_ids=list(self.output_token_ids),
            text=text,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            routed_experts=self.routed_experts() if self.status.done and self.routing else None,
            top_p_token_ids=list(self.top_p_ids) if self.top_p_ids is not None else None,
            spec_verify_ct=self.spec_verify_ct,
        )


@dataclass(eq=False)
class Request:
    """What `add_request` received: the prompt, the parameters and the `n` sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt position {token: logprob} (None where not computed: position
    # 0, before the start); the next position a prefill row may fill (splash/engine/prompt_logprobs.py)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_lp_next: int = 0

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def finished(self) -> bool:
        return all(s.status.done for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.seqs],
            finished=self.finished,
            prompt=self.prompt,
            metrics=RequestMetrics(**vars(self.metrics)) if self.metrics else None,
            num_cached_tokens=max((s.num_cached_tokens for s in self.seqs), default=0),
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )
