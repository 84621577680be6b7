"""Incremental detokenization and stop strings.

Decoding each new token alone breaks multi-byte characters and word-initial spaces, and decoding
the whole output every step is quadratic. So, like vLLM, we decode a short window twice (with and
without the newest tokens) and append the difference, holding back while the tail is an incomplete
UTF-8 sequence. Stop strings are searched only near the new text; while a request runs, the last
`len(longest stop) - 1` characters are withheld from snapshots so streamed text never has to shrink.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded in front of the output, so the first generated word keeps its leading space.
_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = list(stop or [])
        self.include_stop = include_stop  # (vLLM's include_stop_str_in_output: the stop string is kept)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def defer(self, token_id: int) -> None:
        """Queue a token without decoding yet (no stop strings to check): snapshots catch up in one
        decode, so offline runs and slow consumers do not pay two decodes per token."""
        self._pending.append(token_id)

    def _catch_up(self) -> None:
        if self._pending:
            ids, self._pending = self._pending, []
            self.add_many(ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completed ('' while a character is incomplete)."""
        return self.add_many([token_id])

    def add_many(self, token_ids: list[int]) -> str:
        self._catch_up()
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def find_stop(self, delta_len: int) -> str | None:
        """If a stop string now occurs in the text, cut the text before it and return the string."""
        if not self.stop or not delta_len:
            return None
        lo = max(0, len(self.text) - delta_len - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]

    def flush(self) -> None:
        """At finish: emit what an incomplete tail decodes to (replacement chars included)."""
        self._catch_up()
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix):
                self.text += full[len(prefix):]
            self.read_offset = len(self.ids)

    def visible_text(self, finished: bool) -> str:
        self._catch_up()
        if finished or not self.hold:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold)]
