"""Tool-call parsers for the formats whose arguments are a JSON object between special tokens:
DeepSeek-V3, DeepSeek-V3.1 and Kimi-K2 (SGLang's `deepseekv3`, `deepseekv31`, `kimi_k2`).

Their arguments stream as the model writes them (JSON text is passed through, not re-serialized), so
the concatenated fragments of a call are exactly its final `arguments`: the JSON text with the
surrounding whitespace (and DeepSeek-V3's closing code fence) removed.
"""

from __future__ import annotations

import re
from typing import ClassVar

from .base import ToolParser, find_first, partial_suffix

DS_EOS = "<｜end▁of▁sentence｜>"


class JsonToolParser(ToolParser):
    """The machine for "section, then calls of head + JSON arguments" formats."""

    section_begins: ClassVar[tuple[str, ...]] = ()
    section_ends: ClassVar[tuple[str, ...]] = ()
    call_begin: ClassVar[str] = ""
    call_end: ClassVar[str] = ""
    args_begin: ClassVar[str] = ""  # ends the call head, starts the JSON
    trail: ClassVar[str] = " \t\r\n"  # trimmed off the end of the arguments

    def _parse_head(self, head: str) -> tuple[str, str | None] | None:
        """(name, id or None) from the text between the call's begin token and `args_begin`."""
        raise NotImplementedError

    def _on_trigger(self, tok: str) -> None:
        if tok == self.call_begin:  # a call without its section token: accept it, as SGLang does
            self._state = "head"

    def _st_content(self) -> bool:
        return self._scan_content("section")

    def _st_section(self) -> bool:
        self._skip_ws()
        m = self._at((self.call_begin,) + self.section_ends) if self._buf else ""
        if m == "":  # empty or a partial token
            if not self._final:
                return False
            m = None
        if m is None:  # garbage, or the end of the text: a section with calls just ends
            if self._section_calls:
                self._end_section()
                return True
            return self._give_back()
        self._eat(len(m))
        if m == self.call_begin:
            self._state = "head"
        else:
            self._end_section()
        return True

    def _st_head(self) -> bool:
        stops = (self.args_begin, self.call_end, self.call_begin) + self.section_ends
        pos, tok = find_first(self._buf, stops)
        if pos == -1:
            if self._final or len(self._buf) > self.head_limit:
                return self._give_back()
            return False
        if tok != self.args_begin:
            return self._give_back()
        parsed = self._parse_head(self._buf[:pos])
        if parsed is None:
            return self._give_back()
        self._eat(pos + len(tok))
        self._state = "args" if self._announce(*parsed) else "skip"
        return True

    def _st_args(self) -> bool:
        return self._body(emit=True)

    def _st_skip(self) -> bool:
        return self._body(emit=False)

    def _body(self, emit: bool) -> bool:
        stops = (self.call_end, self.call_begin) + self.section_ends
        pos, tok = find_first(self._buf, stops)
        if pos == -1:
            n = len(self._buf) if self._final else len(self._buf) - partial_suffix(self._buf, stops)
            text = self._eat(n)
            if emit:
                self._json_args(text, self.trail)
            if not self._final:
                return False
            self._end_call(not emit)  # cut off: an unknown call is just dropped
            self._state = "section"
            return True
        text = self._eat(pos)
        if emit:
            self._json_args(text, self.trail)
        if tok == self.call_end:
            self._eat(len(tok))
        self._end_call(self._json_args_ok() if emit else True)
        self._state = "section"
        return True


class DeepSeekV3ToolParser(JsonToolParser):
    """DeepSeek-V3 (-0324): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    \\n```json\\n{args}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (the type before the
    separator is always `function`)."""

    name = "deepseekv3"
    section_begins = ("<｜tool▁calls▁begin｜>",)
    section_ends = ("<｜tool▁calls▁end｜>",)
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    args_begin = "```json"
    trail = " \t\r\n`"
    triggers = section_begins + (call_begin,)
    strip_tokens = section_ends + (call_end, DS_EOS)

    def _parse_head(self, head: str) -> tuple[str, str | None] | None:
        kind, sep, name = head.partition("<｜tool▁sep｜>")
        name = name.strip()
        return (name, None) if sep and name else None


class DeepSeekV31ToolParser(JsonToolParser):
    """DeepSeek-V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>
    ...<｜tool▁calls▁end｜>`."""

    name = "deepseekv31"
    section_begins = ("<｜tool▁calls▁begin｜>",)
    section_ends = ("<｜tool▁calls▁end｜>",)
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    args_begin = "<｜tool▁sep｜>"
    triggers = section_begins + (call_begin,)
    strip_tokens = section_ends + (call_end, DS_EOS)

    def _parse_head(self, head: str) -> tuple[str, str | None] | None:
        name = head.strip()
        return (name, None) if name else None


_KIMI_ID = re.compile(r"(?:functions\.)?(.+?):(\d+)")


class KimiK2ToolParser(JsonToolParser):
    """Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {args}<|tool_call_end|><|tool_calls_section_end|>`; the call id is the model's `functions.NAME:IDX`,
    which Kimi's chat template expects back. The singular `<|tool_call_section_begin|>` spelling some
    checkpoints emit is accepted too (as vLLM does)."""

    name = "kimi_k2"
    section_begins = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    section_ends = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    call_begin = "<|tool_call_begin|>"
    call_end = "<|tool_call_end|>"
    args_begin = "<|tool_call_argument_begin|>"
    triggers = section_begins + (call_begin,)
    strip_tokens = section_ends + (call_end, "<|im_end|>")

    def _parse_head(self, head: str) -> tuple[str, str | None] | None:
        head = head.strip()
        m = _KIMI_ID.fullmatch(head)
        if m:
            return m.group(1), head
        name = head.removeprefix("functions.")
        return (name, f"functions.{name}:{self._index + 1}") if name else None
