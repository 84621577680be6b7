"""Structured outputs as a stage: the grammar compiler (made when a request first asks, shared with the
sampler, which masks each guided row's logits) and one matcher (`Guide`) per guided sequence. A token
the matcher refuses, or one that completes the structure, ends the sequence (after the stop tokens and
strings, vLLM's order)."""

from __future__ import annotations

import time
from typing import Any

from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled
from splash.engine.stages.base import Stage, Stop


class Grammar(Stage):
    NAMES = {"grammar": "backend", "grammar_backend": "grammar_backend"}  # what the engine answers for it

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.backend: Any = None  # GrammarBackend (splash/engine/grammar.py), made on first use
        self.guides: dict[Seq, Any] = {}  # the guided sequences' matchers
        self._done: set[Seq] = set()  # sequences whose last token ended (or broke) their structure

    def grammar_backend(self) -> Any:
        """The structured-output compiler (xgrammar over this model's vocabulary), made on first use and
        shared with the sampler; the server compiles through it too (a bad schema is a 400 up front)."""
        if self.backend is None:
            from splash.engine.grammar import GrammarBackend

            eng = self.engine
            self.backend = GrammarBackend(eng.tokenizer, eng.vocab_size or 0, eng.eos_token_ids)
            eng.sampler.grammar = self.backend
        return self.backend

    def on_add(self, seq: Seq) -> None:
        spec = seq.params.structured_outputs
        if spec is not None:  # (a bad schema: GrammarError, a ValueError)
            self.guides[seq] = self.grammar_backend().guide(spec)

    def on_token(self, seq: Seq, s: Sampled, now: float) -> None:
        if not self.guides:
            return
        g = self.guides.get(seq)
        if g is not None:
            t0 = time.perf_counter()
            if not g.accept([s.token_id]) or g.terminated:
                self._done.add(seq)
            self.backend.seconds["accept"] += time.perf_counter() - t0

    def check_stop(self, seq: Seq, tok: int, may_stop: bool) -> Stop | None:
        if self._done and seq in self._done:
            self._done.discard(seq)
            return "stop", None
        return None

    def on_drop(self, seq: Seq) -> None:
        self.guides.pop(seq, None)
        self._done.discard(seq)
