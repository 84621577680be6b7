"""A request (what the user asked for) and its sequences (what the scheduler runs).

A request with `n > 1` becomes `n` independent sequences that share the prompt: each prefills on
its own (no prefix sharing yet), so the scheduler only ever sees single sequences.
"""

from __future__ import annotations

import enum
import itertools
import numbers
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splash.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from splash.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

_seq_ids = itertools.count()


def prompt_ids(prompt: str | None, ids: Any, tokenizer: Any, vocab_size: int | None, max_model_len: int,
               pool_tokens: int) -> list[int]:
    """A request's prompt as a list of token ids (`ids`: a list, numpy array or tensor; else `prompt`
    encoded), or ValueError saying what is wrong: nothing given, not integers, empty, outside the
    vocabulary, or too long for the model's context or for the whole KV pool (it could never run)."""
    if ids is None:
        if prompt is None:
            raise ValueError("give a prompt (text) or prompt_token_ids")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
        ids = tokenizer.encode(prompt)
    if hasattr(ids, "tolist"):  # a numpy array or a tensor of ids
        ids = ids.tolist()
    odd = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if odd:
        raise ValueError(f"prompt_token_ids must be integers, got {odd[0]!r}")  # (1.7 was cut to 1)
    out = [int(t) for t in ids]
    if not out:
        raise ValueError("the prompt is empty; give at least one token")
    if vocab_size is not None:
        bad = next((t for t in out if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(out) >= max_model_len:
        raise ValueError(f"the prompt has {len(out)} tokens but the model's context is "
                         f"{max_model_len}; nothing could be generated. Shorten the prompt.")
    if len(out) >= pool_tokens:
        raise ValueError(f"the prompt has {len(out)} tokens but the whole KV pool holds {pool_tokens}; it "
                         f"can never run. Shorten the prompt or give more memory per rank.")
    return out


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its KV was dropped and will be recomputed)
    RUNNING = "running"  # holds pages; prefilling in chunks or decoding
    FINISHED = "finished"

    @property
    def done(self) -> bool:
        return self is SeqStatus.FINISHED


@dataclass(eq=False)
class Sequence:
    """One generated sequence: what every request has - its tokens, KV page table and progress through the
    cache, owner, status. What a feature keeps per sequence (detokenizer, grammar matcher, logprobs, drafts,
    routed experts, counters) lives in that feature's stage, keyed by the sequence
    (splash/engine/stages/); hashed by identity (`eq=False`)."""

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
    generator: torch.Generator | None = None  # its own random draws (a seeded request), else None
    num_preemptions: int = 0
    # prefix cache (splash/kv/prefix.py): chain keys of its full pages so far, the block (or None: a
    # private page) behind each of its first pages, and the prompt tokens its last admission reused.
    # KV state like `pages` (the scheduler reads them at every admission and page it completes).
    block_keys: list[bytes] = field(default_factory=list)
    cached_blocks: list[Any] = field(default_factory=list)
    num_cached_tokens: int = 0
    cache_epoch: int = 0  # the prefix cache's epoch at admission: it registers pages only in that one

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

    def completion(self, **fields: Any) -> CompletionOutput:
        """A snapshot for the user (lists copied so later steps do not mutate it); `fields`: what the
        engine's stages add (text, logprobs, routed experts, ...)."""
        return CompletionOutput(index=self.index, token_ids=list(self.output_token_ids),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason, **fields)


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

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def finished(self) -> bool:
        return all(s.status.done for s in self.seqs)

    def output(self, outputs: list[CompletionOutput], **fields: Any) -> RequestOutput:
        """A snapshot of the request from its sequences' snapshots; `fields`: what the stages add."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt=self.prompt,
            metrics=RequestMetrics(**vars(self.metrics)) if self.metrics else None,
            num_cached_tokens=max((s.num_cached_tokens for s in self.seqs), default=0),
            **fields,
        )
