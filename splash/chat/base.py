"""What every tool-call parser shares: the call and delta records, the schema-type lookup that turns a
parameter's text into a JSON value, and `ToolParser`, the streaming machine the formats build on.

One machine serves both the full and the streamed case (`extract` feeds the whole text at once), so a
response parsed whole and the same response streamed in any chunking give the same calls and content.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object's text, as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: its first delta has `id` and `name` (and empty `arguments`), the
    later ones only argument text; joining a call's `arguments` pieces gives its final JSON."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index, "function": fn}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            fn["name"] = self.name
        return out


Delta = str | ToolCallDelta  # content text, or a piece of a tool call


def new_call_id() -> str:
    """An OpenAI-style id (`call_` and 24 hex digits), as SGLang and vLLM mint them."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start (not the whole) of a marker: the part a
    stream must hold back, since the next chunk may complete the marker."""
    best = 0
    for m in markers:
        i = text.find(m[0], max(0, len(text) - len(m) + 1))  # the tail's first candidate start
        while i != -1 and len(text) - i > best:
            if m.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(m[0], i + 1)
    return best


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest marker in `text` and its position, or (-1, "")."""
    pos, tok = -1, ""
    for m in markers:
        i = text.find(m)
        if i != -1 and (pos == -1 or i < pos):
            pos, tok = i, m
    return pos, tok


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """Tool name -> its parameters' `properties`, from OpenAI tools (or bare function dicts); None when
    no tools are given, which turns name checking off."""
    if not tools:
        return None
    out = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if fn.get("name"):
            params = fn.get("parameters") or {}
            out[fn["name"]] = params.get("properties") or {} if isinstance(params, dict) else {}
    return out


def schema_types(prop: Any) -> set[str] | None:
    """The JSON types a property's schema allows (`type`, a type list, anyOf/oneOf/allOf, enum, const);
    None when the schema does not say."""
    if not isinstance(prop, dict):
        return None
    types: set[str] = set()
    t = prop.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in prop.get(key) or []:
            types |= schema_types(branch) or set()
    values = [prop["const"]] if "const" in prop else prop.get("enum") or []
    for v in values:
        types.add({bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(v), "object"))
    if not types and "properties" in prop:
        types.add("object")
    if not types and "items" in prop:
        types.add("array")
    return types or None


def streams_as_string(types: set[str] | None, string_hint: bool | None) -> bool:
    """Whether a value is kept as the raw text (and so can stream as it arrives): the schema says
    string only, or says nothing and the model marked it string (DSML's string="true")."""
    if types is not None:
        return types <= {"string"}
    return string_hint is True


def convert_value(raw: str, types: set[str] | None, string_hint: bool | None) -> Any:
    """A parameter's text as a JSON value: the schema decides first (string stays string; a non-string
    type is parsed as JSON), then the model's own hint; text that does not parse stays a string."""
    if streams_as_string(types, string_hint):
        return raw
    text = raw.strip()
    try:  # (NaN and Infinity are no JSON; a number past float range keeps its text: _BigNumber)
        value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except ValueError:
        low = text.lower()
        if types and "boolean" in types and low in ("true", "false"):
            return low == "true"
        return raw
    if types is None:
        # No schema: the hint said non-string, or (GLM) nothing was said: keep JSON unless it is a string.
        return raw if isinstance(value, str) and string_hint is None else value
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    kind = "null" if value is None else "number" if isinstance(value, _BigNumber) else names[type(value)]
    fits = kind in types or (kind == "integer" and "number" in types)
    return value if fits or "string" not in types else raw


class _BigNumber(str):
    """A JSON number past float range (`1e999`), kept as its text: JSON numbers have no range, and
    a float would write it as Infinity, which no strict JSON client reads."""


def _finite_float(text: str) -> float | _BigNumber:
    v = float(text)
    return v if math.isfinite(v) else _BigNumber(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def dumps(value: Any) -> str:
    """JSON text of a parsed value, numbers past float range written as they came."""
    big: list[str] = []

    def mark(v: Any) -> Any:
        if isinstance(v, _BigNumber):
            big.append(str(v))
            return f"\x00{len(big) - 1}\x00"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(value), ensure_ascii=False)
    for i, b in enumerate(big):
        text = text.replace(json.dumps(f"\x00{i}\x00"), b)
    return text


class ToolParser:
    """A streaming tool-call parser for one model family; `feed` deltas of generated text, then `finish`.

    Text outside tool sections is content; the whitespace around a section is the format's separator
    and is dropped (content on both sides keeps the whitespace that preceded the section), and special
    tokens that are no content (eos, stray closing tokens) are dropped too. A partial special token at
    the end of a chunk is held back. A call is announced (index, id, name, empty arguments) once its
    name is complete; its arguments then stream.

    Unknown tools follow SGLang's default: when `tools` are given, a call naming a tool not among them
    is dropped (not returned as content); `forward_unknown=True` keeps it, like
    SGLANG_FORWARD_UNKNOWN_TOOLS. Without tools (None or []) every name is accepted.

    Malformed output never raises: a section or call that breaks before its name is announced comes back
    as content, streamed or not. A call that breaks after its name was announced (bad JSON, cut off)
    is dropped by `extract`, which returns its text as content; a stream cannot take back what it sent,
    so there the call simply ends where the text ended.
    """

    name: ClassVar[str] = ""
    triggers: ClassVar[tuple[str, ...]] = ()  # tokens that open a tool section in content
    strip_tokens: ClassVar[tuple[str, ...]] = ()  # dropped from content (eos, stray closing tokens)
    head_limit: ClassVar[int] = 1024  # characters a call head may take before it counts as malformed

    def __init__(self, tools: list[dict[str, Any]] | None = None, *, forward_unknown: bool = False) -> None:
        self.tools = tools
        self._schemas = tool_schemas(tools)
        self._forward_unknown = forward_unknown
        self._buf = ""
        self._raw: list[str] = []  # text eaten since content or the last call ended: a failure's fallback
        self._ws_hold = ""  # trailing content whitespace, dropped if a section follows
        self._lstrip = False  # drop leading content whitespace (right after a section)
        self._sep = ""  # whitespace that preceded the section: it separates content around it
        self._said = False  # some content was emitted
        self._state = "content"
        self._final = False
        self._out: list[Delta] = []
        self._index = -1
        self._active = False  # an announced call is open
        self._call_name = ""
        self._args_out: list[str] = []  # the open call's streamed arguments
        self._args_hold = ""
        self._section_calls = 0
        self._extracting = False
        self._x_content: list[str] = []
        self._x_calls: dict[int, list[str]] = {}

    # -- public API --------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        """Deltas for the next piece of generated text: content strings and ToolCallDelta records."""
        self._buf += text
        self._run()
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Delta]:
        """Flush at the end of generation: held-back text is released, unterminated sections resolved."""
        self._final = True
        self._run()
        if self._ws_hold and not self._lstrip:
            self._emit(self._ws_hold)
        self._ws_hold = ""
        out, self._out = self._out, []
        return out

    @classmethod
    def extract(
        cls, text: str, tools: list[dict[str, Any]] | None = None, *, forward_unknown: bool = False
    ) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole response."""
        p = cls(tools, forward_unknown=forward_unknown)
        p._extracting = True
        p.feed(text)
        p.finish()
        calls = [ToolCall(c[0], c[1], c[2]) for _, c in sorted(p._x_calls.items())]
        return "".join(p._x_content), calls

    # -- machinery for the formats -----------------------------------------------------------------

    def _run(self) -> None:
        for _ in range(1_000_000):  # each step consumes text or changes state; the bound is a guard
            if not getattr(self, "_st_" + self._state)():
                return

    def _emit(self, item: Delta) -> None:
        if not self._extracting:
            self._out.append(item)
        elif isinstance(item, str):
            self._x_content.append(item)
        elif item.name is not None:
            self._x_calls[item.index] = [item.id or "", item.name, ""]
        else:
            self._x_calls[item.index][2] += item.arguments

    def _eat(self, n: int) -> str:
        s, self._buf = self._buf[:n], self._buf[n:]
        self._raw.append(s)
        return s

    def _skip_ws(self) -> None:
        self._eat(len(self._buf) - len(self._buf.lstrip()))

    def _safe(self, markers: tuple[str, ...]) -> int:
        """How much of the buffer is surely not the start of one of `markers`."""
        return len(self._buf) if self._final else len(self._buf) - partial_suffix(self._buf, markers)

    def _at(self, markers: tuple[str, ...]) -> str | None:
        """The marker the buffer starts with; "" while it may still become one; None if it cannot."""
        for m in markers:
            if self._buf.startswith(m):
                return m
        if not self._final and any(m.startswith(self._buf) for m in markers):
            return ""
        return None

    def _content(self, text: str) -> None:
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        held = self._ws_hold + text
        body = held.rstrip()
        self._ws_hold = held[len(body) :]
        if body:
            self._said = True
            self._emit(body)

    def _scan_content(self, on_trigger: str) -> bool:
        """The content state: emit text up to a trigger (then go to `on_trigger`), dropping strip tokens."""
        pos, tok = find_first(self._buf, self.triggers + self.strip_tokens)
        if pos == -1:
            n = self._safe(self.triggers + self.strip_tokens)
            self._content(self._buf[:n])
            self._buf = self._buf[n:]
            return False
        self._content(self._buf[:pos])
        self._buf = self._buf[pos + len(tok) :]
        if tok in self.strip_tokens:
            return True
        self._raw, self._sep, self._section_calls = [self._ws_hold, tok], self._ws_hold, 0
        self._ws_hold = ""
        self._state = on_trigger
        self._on_trigger(tok)
        return True

    def _on_trigger(self, tok: str) -> None:
        """Hook: which trigger opened the section (some formats enter a call directly)."""

    def _give_back(self) -> bool:
        """A section or call head that broke before any name was announced: its text is content again."""
        raw, self._raw = "".join(self._raw), []
        self._content(raw)
        self._state = "content"
        return True

    def _announce(self, name: str, call_id: str | None = None) -> bool:
        """Open a call; False (and nothing sent) for an unknown tool that is to be dropped."""
        if self._schemas is not None and name not in self._schemas and not self._forward_unknown:
            return False
        self._index += 1
        self._active, self._call_name, self._args_out, self._args_hold = True, name, [], ""
        self._emit(ToolCallDelta(self._index, call_id or new_call_id(), name, ""))
        return True

    def _args(self, text: str) -> None:
        if text and self._active:
            self._args_out.append(text)
            self._emit(ToolCallDelta(self._index, arguments=text))

    def _json_args(self, text: str, trail: str = " \t\r\n") -> None:
        """Stream raw JSON argument text, trimmed: leading whitespace dropped, trailing `trail`
        characters held until more text follows (they are dropped if the call ends there)."""
        if not self._args_out and not self._args_hold:
            text = text.lstrip()
        held = self._args_hold + text
        body = held.rstrip(trail)
        self._args_hold = held[len(body) :]
        self._args(body)

    def _json_args_ok(self) -> bool:
        """Whether the streamed arguments are a JSON object; empty ones become `{}`."""
        try:
            ok = isinstance(json.loads("".join(self._args_out) or "{}"), dict)
        except ValueError:
            return False
        if not self._args_out:
            self._args("{}")
        return ok

    def _end_call(self, ok: bool) -> None:
        """Close the open call; a failed one is dropped by `extract`, its text turned back into content."""
        if ok:
            self._section_calls += 1
        elif self._active and self._extracting:
            self._x_calls.pop(self._index, None)
            self._content("".join(self._raw))
        self._active = False
        self._raw = []

    def _end_section(self) -> None:
        """Whitespace after a section is dropped; content on both sides keeps the whitespace before it."""
        self._raw = []
        self._lstrip = True
        self._ws_hold = self._sep if self._said else ""
        self._state = "content"
