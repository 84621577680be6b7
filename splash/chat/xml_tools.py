"""Tool-call parsers for the formats that write each argument as a tagged key/value pair: GLM-4.5 to
GLM-5 (SGLang's `glm45`/`glm47`, vLLM's `glm45`) and DeepSeek-V3.2's DSML (`deepseekv32`).

The arguments JSON is built as the pairs arrive: `{"key": ` when a key closes, then the value. A value
whose schema type is string (or, for DSML without a schema, marked string="true") streams character by
character as a JSON string; any other value is converted at its closing tag, by the tool's JSON schema
(see base.convert_value). So the fragments of a call concatenate to its final `arguments`.
"""

from __future__ import annotations

import re
from typing import Any

from .base import (
    ToolParser,
    convert_value,
    dumps,
    find_first,
    partial_suffix,
    schema_types,
    streams_as_string,
)
from .json_tools import DS_EOS


class XmlToolParser(ToolParser):
    """Shared machinery: key/value parameters streamed into one JSON object."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, *, forward_unknown: bool = False) -> None:
        super().__init__(tools, forward_unknown=forward_unknown)
        self._nkeys = 0
        self._key = ""
        self._vstring = False
        self._vbuf = ""
        self._vtypes: set[str] | None = None
        self._vhint: bool | None = None
        self._broken = False

    def _start_call(self, name: str) -> None:
        self._nkeys, self._broken = 0, False
        self._state = "body" if self._announce(name) else "skip"

    def _open_value(self, hint: bool | None) -> None:
        props = (self._schemas or {}).get(self._call_name) or {}
        self._vtypes, self._vhint, self._vbuf = schema_types(props.get(self._key)), hint, ""
        self._vstring = streams_as_string(self._vtypes, hint)
        self._args(
            ("{" if self._nkeys == 0 else ", ") + dumps(self._key) + ": " + ('"' if self._vstring else "")
        )
        self._nkeys += 1

    def _value_text(self, text: str) -> None:
        if self._vstring:
            self._args(dumps(text)[1:-1])
        else:
            self._vbuf += text

    def _close_value(self) -> None:
        self._args('"' if self._vstring else dumps(convert_value(self._vbuf, self._vtypes, self._vhint)))

    def _close_args(self) -> None:
        self._args("}" if self._nkeys else "{}")

    def _value(self, close: str, stops: tuple[str, ...], after: str) -> bool:
        """Stream a value up to its closing tag `close`; any of `stops` first means the call is broken."""
        pos, tok = find_first(self._buf, (close,) + stops)
        if pos == -1:
            if self._final:
                return self._break()
            self._value_text(self._eat(len(self._buf) - partial_suffix(self._buf, (close,) + stops)))
            return False
        if tok != close:
            return self._break()
        self._value_text(self._eat(pos))
        self._eat(len(close))
        self._close_value()
        self._state = after
        return True

    def _break(self) -> bool:
        """Malformed inside an announced call: skip to its end; `extract` returns its text as content."""
        self._broken = True
        self._state = "skip"
        return True

    def _skip_to(self, close: str, stops: tuple[str, ...], after: str) -> bool:
        """Consume a dropped or broken call up to `close` (eaten) or one of `stops` (left in place)."""
        pos, tok = find_first(self._buf, (close,) + stops)
        if pos == -1 and not self._final:
            self._eat(len(self._buf) - partial_suffix(self._buf, (close,) + stops))
            return False
        self._eat(len(self._buf) if pos == -1 else pos + (len(tok) if tok == close else 0))
        self._end_call(not self._broken and (tok == close or not self._active))
        self._state = after
        if after == "content":
            self._end_section()
        return True


class Glm45ToolParser(XmlToolParser):
    """GLM-4.5/4.6: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`;
    GLM-4.7/GLM-5 write the same without the newlines, which this parser accepts as well. Values are
    typed by the tool's schema; without one, a value that parses as a non-string JSON value is taken as
    that value (as SGLang's GLM-4.7 parser does), else it stays a string."""

    name = "glm45"
    triggers = ("<tool_call>",)
    strip_tokens = ("</tool_call>", "<|user|>", "<|observation|>", "<|endoftext|>")
    _CALL_STOPS = ("</tool_call>", "<tool_call>")

    def _st_content(self) -> bool:
        return self._scan_content("head")

    def _st_head(self) -> bool:
        self._skip_ws()
        pos, tok = find_first(self._buf, ("\n", "<arg_key>") + self._CALL_STOPS)
        if pos == -1:
            if self._final or len(self._buf) > self.head_limit:
                return self._give_back()
            return False
        name = self._buf[:pos].strip()
        if tok == "<tool_call>" or not name:
            return self._give_back()
        self._eat(pos)
        self._start_call(name)
        return True

    def _st_body(self) -> bool:
        self._skip_ws()
        m = self._at(("<arg_key>", "</tool_call>"))
        if m == "" or (not self._buf and not self._final):
            return False
        if not m:
            return self._break()
        self._eat(len(m))
        if m == "<arg_key>":
            self._state = "key"
            return True
        self._close_args()
        self._end_call(True)
        self._end_section()
        return True

    def _st_key(self) -> bool:
        pos, tok = find_first(self._buf, ("</arg_key>", "<arg_value>", "<arg_key>") + self._CALL_STOPS)
        if pos == -1:
            return self._break() if self._final or len(self._buf) > self.head_limit else False
        if tok != "</arg_key>":
            return self._break()
        self._key = self._eat(pos).strip()
        self._eat(len(tok))
        self._state = "wait_value"
        return True

    def _st_wait_value(self) -> bool:
        self._skip_ws()
        m = self._at(("<arg_value>",))
        if m == "" or (not self._buf and not self._final):
            return False
        if not m:
            return self._break()
        self._eat(len(m))
        self._open_value(None)
        self._state = "value"
        return True

    def _st_value(self) -> bool:
        return self._value("</arg_value>", self._CALL_STOPS + ("<arg_key>",), "body")

    def _st_skip(self) -> bool:
        return self._skip_to("</tool_call>", ("<tool_call>",), "content")


_DSML_NAME = re.compile(r'\s+name="([^"]*)"\s*')
_DSML_PARAM = re.compile(r'\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*')


class DeepSeekV32ToolParser(XmlToolParser):
    """DeepSeek-V3.2's DSML: `<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter
    name="K" string="true|false">V</｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n</｜DSML｜function_calls>`
    (encoding_dsv32.py). string="true" values are the raw text, string="false" ones JSON; the tool's
    schema, when it has the key, decides first. An invoke whose body is one JSON object (a variant
    SGLang accepts) streams that object as is."""

    name = "deepseekv32"
    OPEN, CLOSE = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
    INVOKE, INVOKE_END = "<｜DSML｜invoke", "</｜DSML｜invoke>"
    PARAM, PARAM_END = "<｜DSML｜parameter", "</｜DSML｜parameter>"
    triggers = (OPEN,)
    strip_tokens = (CLOSE, INVOKE_END, PARAM_END, DS_EOS)

    def _st_content(self) -> bool:
        return self._scan_content("section")

    def _st_section(self) -> bool:
        self._skip_ws()
        m = self._at((self.INVOKE, self.CLOSE)) if self._buf else ""
        if m == "" and not self._final:
            return False
        if not m:  # garbage, or the end of the text: a section with calls just ends
            if self._section_calls:
                self._end_section()
                return True
            return self._give_back()
        self._eat(len(m))
        if m == self.CLOSE:
            self._end_section()
        else:
            self._state = "head"
        return True

    def _tag_attrs(self, pattern: re.Pattern[str]) -> re.Match[str] | None | bool:
        """The attributes of the tag being read (up to `>`, eaten); False while incomplete, None if bad."""
        pos = self._buf.find(">")
        if pos == -1:
            return None if self._final or len(self._buf) > self.head_limit else False
        m = pattern.fullmatch(self._buf[:pos])
        if m:
            self._eat(pos + 1)
        return m

    def _st_head(self) -> bool:
        m = self._tag_attrs(_DSML_NAME)
        if m is False:
            return False
        if m is None or not m.group(1).strip():
            return self._give_back()
        self._start_call(m.group(1).strip())
        return True

    def _st_body(self) -> bool:
        self._skip_ws()
        m = self._at((self.PARAM, self.INVOKE_END, "{"))
        if m == "" or (not self._buf and not self._final):
            return False
        if not m:
            return self._break()
        if m == "{":
            self._state = "json"
            return True
        self._eat(len(m))
        if m == self.PARAM:
            self._state = "param"
            return True
        self._close_args()
        self._end_call(True)
        self._state = "section"
        return True

    def _st_param(self) -> bool:
        m = self._tag_attrs(_DSML_PARAM)
        if m is False:
            return False
        if m is None:
            return self._break()
        self._key = m.group(1)
        self._open_value({"true": True, "false": False}.get(m.group(2) or ""))
        self._state = "value"
        return True

    def _st_value(self) -> bool:
        return self._value(self.PARAM_END, (self.INVOKE_END, self.CLOSE, self.PARAM), "body")

    def _st_json(self) -> bool:
        pos, tok = find_first(self._buf, (self.INVOKE_END, self.CLOSE, self.INVOKE))
        if pos == -1:
            if self._final:
                return self._break()
            self._json_args(self._eat(len(self._buf) - partial_suffix(self._buf, (self.INVOKE_END,))))
            return False
        self._json_args(self._eat(pos))
        if tok != self.INVOKE_END:
            return self._break()
        self._eat(len(tok))
        self._end_call(self._json_args_ok())
        self._state = "section"
        return True

    def _st_skip(self) -> bool:
        return self._skip_to(self.INVOKE_END, (self.CLOSE,), "section")
