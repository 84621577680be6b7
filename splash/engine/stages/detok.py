"""Text and stop strings: each sequence's incremental detokenizer (splash/engine/detokenizer.py), made
when the engine has a tokenizer. A request without stop strings defers decoding to its snapshots; one
with them decodes each token and ends where a stop string appears (after the stop tokens, before the
grammar's end and the length limit: vLLM's order)."""

from __future__ import annotations

from typing import Any

from splash.engine.detokenizer import IncrementalDetokenizer
from splash.engine.request import Sequence as Seq
from splash.engine.stages.base import Stage, Stop


class Detokenize(Stage):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.detok: dict[Seq, IncrementalDetokenizer] = {}

    def on_add(self, seq: Seq) -> None:
        tok = self.engine.tokenizer
        if tok is not None:
            p = seq.params
            self.detok[seq] = IncrementalDetokenizer(tok, seq.prompt_token_ids, p.stop, p.skip_special_tokens,
                                                     p.include_stop_str_in_output)

    def check_stop(self, seq: Seq, tok: int, may_stop: bool) -> Stop | None:
        d = self.detok.get(seq)
        if d is None:
            return None
        if not seq.params.stop:
            d.defer(tok)
            return None
        delta = d.add(tok)
        if may_stop:
            hit = d.find_stop(len(delta))
            if hit is not None:
                return "stop", hit
        return None

    def on_finish(self, seq: Seq) -> None:
        d = self.detok.get(seq)
        if d is not None and seq.finish_reason == "length":
            d.flush()

    def output(self, seq: Seq, fields: dict[str, Any]) -> None:
        d = self.detok.get(seq)
        if d is not None:
            fields["text"] = d.visible_text(seq.status.done)

    def on_drop(self, seq: Seq) -> None:
        self.detok.pop(seq, None)
