"""What a request asked to get back per generated token: its logprobs (`SamplingParams.logprobs`: the
token's and the top few) and, for RL replay, the set it was drawn from (`return_top_p_token_ids`). Only
the sequences that asked have an entry in this stage's tables."""

from __future__ import annotations

from typing import Any

from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled
from splash.engine.stages.base import Stage


class Logprobs(Stage):
    def __init__(self) -> None:
        self.logprobs: dict[Seq, list[dict[int, float]]] = {}
        self.top_p_ids: dict[Seq, list[list[int]]] = {}

    def on_add(self, seq: Seq) -> None:
        p = seq.params
        if p.logprobs is not None:
            self.logprobs[seq] = []
        if p.return_top_p_token_ids:
            self.top_p_ids[seq] = []

    def on_token(self, seq: Seq, s: Sampled, now: float) -> None:
        if self.logprobs and s.logprobs is not None:
            got = self.logprobs.get(seq)
            if got is not None:
                got.append(s.logprobs)
        if self.top_p_ids and s.top_p_ids is not None:
            ids = self.top_p_ids.get(seq)
            if ids is not None:
                ids.append(s.top_p_ids)

    def output(self, seq: Seq, fields: dict[str, Any]) -> None:
        got = self.logprobs.get(seq)
        if got is not None:
            fields["logprobs"] = list(got)
        ids = self.top_p_ids.get(seq)
        if ids is not None:
            fields["top_p_token_ids"] = list(ids)

    def on_drop(self, seq: Seq) -> None:
        self.logprobs.pop(seq, None)
        self.top_p_ids.pop(seq, None)
