"""Grammars that force a tool call: OpenAI's `tool_choice` "required" and named
(`{"type": "function", "function": {"name": ...}}`) as an xgrammar structural tag, one per tool-call
format, so that whatever the model samples is a call the family's parser parses (no leftover content)
with arguments that validate against the tool's `parameters` schema.

`tool_call_structural_tag(parser, tools, choice, parallel)` returns the structural tag's JSON text
(`{"type": "structural_tag", "format": {...}}`, which `GrammarCompiler.compile_structural_tag`
compiles; built from the format types const_string, sequence, or, plus, tag, regex, any_text and
json_schema, checked with xgrammar 0.2.8), which the server hands the engine as
`StructuredOutputs(structural_tag=...)`. The whole answer is the family's tool section:

- deepseekv3:  `<｜tool▁calls▁begin｜>` then calls `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{args}\\n```<｜tool▁call▁end｜>` (optionally newline-separated), then `<｜tool▁calls▁end｜>`;
- deepseekv31: the same section with calls `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>`;
- kimi_k2: `<|tool_calls_section_begin|>` then `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{args}<|tool_call_end|>`... then `<|tool_calls_section_end|>`;
- glm45 (GLM-4.5 .. GLM-5): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
  per call, the newlines of GLM-4.5's layout optional;
- deepseekv32 (DSML): `<｜DSML｜function_calls>` then `<｜DSML｜invoke name="NAME">` with
  `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` lines, after an optional "\\n\\n".

JSON arguments follow the whole `parameters` schema (xgrammar's JSON-schema grammar: declared properties
in schema order, whitespace runs of at most MAX_WHITESPACE). The key/value formats write the schema's
properties in schema order, every required one and any optional ones: a value the parser keeps as raw
text (the property's schema types are string only) is text of the string's constraints (enum/const,
pattern, min/maxLength), anything else is JSON of the property's schema (DSML's string="false"), a
string too where the types mix string with others (`["string", "null"]`: `"text"`, quoted).

No text the grammar allows can end a value early in the parser: free text and JSON strings exclude
the family's special tokens, and the strings whose length is bounded (JSON strings with a min or
maxLength, raw values with a maxLength: xgrammar drops a JSON string's length where it excludes
text, and its free text's max_chars miscounts a character split across tokens) are `[^<]{min,max}`
patterns: no `<`, so no special token, and no JSON escapes or UTF-16 surrogates. A user's own
`pattern` is taken as is; `format` is not enforced on raw-text values (JSON Schema treats it as an
annotation). Numbers are xgrammar's JSON numbers (an exponent of any size).

Standard library only; nothing from splash outside splash.chat. Bad input (an unknown parser, an
unknown named function, a tool whose schema cannot be enforced) raises ValueError.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from .base import schema_types, streams_as_string
from .json_tools import DS_EOS

Format = dict[str, Any]

# Whitespace between JSON tokens of the arguments, at most: room for `{"k": v}` and a two-space indent,
# and a bound on the whitespace runs a weak or quantised model can fall into (each still a valid call).
MAX_WHITESPACE = 4
KIMI_INDEX = "[0-9]{1,6}"  # the call index in `functions.NAME:IDX` (bounded: the parser's head limit)

# Special tokens of each family that no value, JSON string or free text may contain.
_DS_JSON_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                   "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", DS_EOS)
_KIMI_TOKENS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_section_begin|>",
                "<|tool_call_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
                "<|tool_call_argument_begin|>", "<|im_end|>")
_GLM_TOKENS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
               "<|user|>", "<|observation|>", "<|endoftext|>")
_DSML = "｜DSML｜"
_DSML_TOKENS = (f"<{_DSML}function_calls>", f"</{_DSML}function_calls>", f"<{_DSML}invoke",
                f"</{_DSML}invoke>", f"<{_DSML}parameter", f"</{_DSML}parameter>", DS_EOS)

_ANNOTATIONS = {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                "$comment"}
_BAD_NAME = re.compile(r"[\s<>\"`]")  # what would end a call head early in some parser


def tool_call_structural_tag(
    parser: str, tools: list[dict[str, Any]], choice: str | dict[str, Any] = "required", parallel: bool = True
) -> str:
    """The xgrammar structural tag (JSON text) that makes the whole answer a tool section of `parser`'s
    format: one or more calls (exactly one when `parallel` is false or `choice` names a function) to
    `tools` (only the named one), with arguments matching the tool's `parameters`. `parser` takes the
    names of `splash.chat.TOOL_PARSERS`; `choice` is "required" or OpenAI's named tool choice."""
    from . import tool_parser  # the package may import this module: resolve the registry lazily

    family = tool_parser(parser).name
    functions = _functions(tools)
    if choice == "required":
        chosen, single = functions, not parallel
    else:
        name = _named(choice)
        chosen = [f for f in functions if f[0] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools "
                             f"({', '.join(f[0] for f in functions)})")
        single = True
    fmt = _FAMILIES[family](chosen, single)
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


# -- input checks ----------------------------------------------------------------------------------


def _named(choice: Any) -> str:
    if isinstance(choice, dict):
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            return name
        raise ValueError(f"named tool_choice needs function.name: {choice!r}")
    raise ValueError(f"tool_choice {choice!r} is not enforced by a grammar: use \"required\" or "
                     '{"type": "function", "function": {"name": ...}}')


def _functions(tools: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each function tool, checked."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool_choice \"required\" or named needs a non-empty list of tools")
    out: list[tuple[str, dict[str, Any]]] = []
    for t in tools:
        if not isinstance(t, dict):
            raise ValueError(f"a tool must be an object: {t!r}")
        if t.get("type", "function") != "function":
            continue
        fn = t.get("function", t)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool has no function name: {t!r}")
        if _BAD_NAME.search(name):
            raise ValueError(f"tool name {name!r} cannot be written in a tool call (whitespace, double "
                             "quote, backtick or angle bracket)")
        if any(name == n for n, _ in out):
            raise ValueError(f"two tools are named {name!r}")
        out.append((name, _parameters(name, fn.get("parameters"))))
    if not out:
        raise ValueError("none of the tools is a function")
    return out


def _parameters(name: str, params: Any) -> dict[str, Any]:
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema object, got {params!r}")
    if params.get("type", "object") != "object":
        raise ValueError(f"tool {name!r}: parameters must be an object schema (type \"object\"), "
                         f"got type {params.get('type')!r}")
    props = params.get("properties", {})
    required = params.get("required", [])
    if not isinstance(props, dict):
        raise ValueError(f"tool {name!r}: parameters.properties must be an object")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ValueError(f"tool {name!r}: parameters.required must be a list of names")
    for key, prop in props.items():
        if prop is False and key in required:
            raise ValueError(f"tool {name!r}: required property {key!r} has the schema false")
        if not isinstance(prop, (dict, bool)):
            raise ValueError(f"tool {name!r}: the schema of property {key!r} is not an object")
    return {**params, "type": "object"}


# -- structural-tag building blocks ----------------------------------------------------------------


def _const(value: str) -> Format:
    return {"type": "const_string", "value": value}


def _seq(*elements: Format) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def _or(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _opt(fmt: Format) -> Format:
    return _or([_const(""), fmt])


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _regex(pattern: str) -> Format:
    return {"type": "regex", "pattern": pattern}


def _text(excludes: tuple[str, ...]) -> Format:
    """Free text (inside a tag, whose end it cannot contain) without the `excludes`."""
    return {"type": "any_text", "excludes": list(excludes)}


def _json(schema: Any, excludes: tuple[str, ...]) -> Format:
    return {"type": "json_schema", "json_schema": _guard_strings(schema), "style": "json",
            "max_whitespace_cnt": MAX_WHITESPACE, "excludes": list(excludes)}


def _calls(calls: list[Format], single: bool, sep: Format | None = None) -> Format:
    """One call among `calls`, or one or more (each preceded by `sep`)."""
    one = _or(calls) if sep is None else _seq(sep, _or(calls))
    return one if single else {"type": "plus", "content": one}


# A character of a length-bounded value: no `<` (every special token starts with one), no UTF-16
# surrogate (xgrammar's character classes would otherwise take their CESU-8 bytes).
_CHAR = "[^<\\uD800-\\uDFFF]"


def _length_pattern(lo: int, hi: int | None) -> str:
    return f"{_CHAR}{{{lo},{'' if hi is None else hi}}}"


def _guard_strings(schema: Any) -> Any:
    """A copy of `schema` whose length-bounded strings are patterns without `<`: xgrammar drops
    min/maxLength where it filters excluded substrings, but filters no pattern."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
            return
        if not isinstance(node, dict):
            return
        t = node.get("type")
        is_str = t == "string" or (isinstance(t, list) and "string" in t)
        if is_str and ("minLength" in node or "maxLength" in node) and not (
            {"pattern", "format", "enum", "const"} & node.keys()
        ):
            lo, hi = int(node.pop("minLength", 0)), node.pop("maxLength", None)
            node["pattern"] = _length_pattern(lo, None if hi is None else int(hi))
        for key, value in node.items():
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                if isinstance(value, dict):
                    for sub in value.values():
                        walk(sub)
            elif key not in ("enum", "const", "default", "examples", "required"):
                walk(value)

    walk(schema)
    return schema


# -- key/value arguments (GLM, DSML) ---------------------------------------------------------------


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """`schema` with a local `$ref` (#/$defs/X, #/definitions/X) at its top replaced by its target."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"cannot resolve $ref {ref!r} (only local references are supported)")
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"$ref {ref!r} points nowhere")
            target = target[part]
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest} if isinstance(target, dict) else target
        seen += 1
    return {} if schema is True else schema


def _with_defs(schema: Any, root: dict[str, Any]) -> Any:
    """A property's schema, carrying the root's definitions so that nested `$ref`s resolve."""
    if not isinstance(schema, dict):
        return schema
    extra = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in schema}
    return {**schema, **extra} if extra else schema


def _unconstrained(schema: Any) -> bool:
    return schema is True or (isinstance(schema, dict) and not (schema.keys() - _ANNOTATIONS))


def _parses_as_json(text: str) -> bool:
    try:
        json.loads(text.strip())
    except ValueError:
        return False
    return True


def _raw_text(
    where: str, schema: Any, root: dict[str, Any], excludes: tuple[str, ...], untyped: bool
) -> Format:
    """A value the parser keeps as the raw text (up to the closing tag): the string constraints of
    `schema`. `untyped`: the parser sees no type (GLM then parses text that is JSON as JSON), so only
    enum/const values that are no JSON can be offered."""
    s = _resolve(schema, root)
    if not isinstance(s, dict):
        raise ValueError(f"{where}: the schema false allows no value")
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list):
            raise ValueError(f"{where}: enum must be a list")
        ok = [v for v in values if isinstance(v, str) and not any(x in v for x in excludes)
              and not (untyped and _parses_as_json(v))]
        if not ok:
            raise ValueError(f"{where}: none of its enum values can be written as a value")
        return _or([_const(v) for v in ok])
    for key in ("anyOf", "oneOf"):
        branches = s.get(key)
        if isinstance(branches, list) and branches:
            subs = []
            for b in branches:
                types = schema_types(_resolve(b, root))
                if types is not None and types <= {"string"}:
                    subs.append(_raw_text(where, b, root, excludes, untyped))
            if not subs:
                raise ValueError(f"{where}: no string branch in {key}")
            return _or(subs)
    if untyped:
        raise ValueError(f"{where}: the parser sees no type in the property's schema (a $ref?), so a "
                         "free string value could be read as JSON; give the property an explicit type")
    if "allOf" in s:
        raise ValueError(f"{where}: allOf in a string schema cannot be enforced on a raw value")
    if "pattern" in s:
        return _regex(str(s["pattern"]))
    lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
    if hi is not None:  # (any_text's max_chars miscounts a character split across tokens)
        if int(hi) < lo:
            raise ValueError(f"{where}: maxLength is below minLength")
        return _regex(_length_pattern(lo, int(hi)))
    if lo == 0:
        return _text(excludes)
    # no `<` in the first lo characters, so no special token can start there
    return _seq(_regex(f"{_CHAR}{{{lo}}}"), _text(excludes))


def _kv_value(
    family: str, fn: str, key: str, prop: Any, root: dict[str, Any], excludes: tuple[str, ...]
) -> tuple[bool, Format]:
    """(as raw text, content format) of one key/value argument, decided as the parser decides."""
    where = f"tool {fn!r}, property {key!r}"
    types = schema_types(prop)
    if streams_as_string(types, None):
        return True, _raw_text(where, prop, root, excludes, untyped=False)
    if types is not None or _unconstrained(prop):
        return False, _json(_with_defs(_resolve(prop, root), root), excludes)
    # The parser sees no type (a $ref): what it does with the text depends on the format.
    resolved = _resolve(prop, root)
    rtypes = schema_types(resolved)
    if rtypes is not None and "string" not in rtypes:
        return False, _json(_with_defs(resolved, root), excludes)
    if family == "deepseekv32":  # the string="true|false" hint decides
        if rtypes is not None and rtypes <= {"string"}:
            return True, _raw_text(where, resolved, root, excludes, untyped=False)
        return False, _json(_with_defs(resolved, root), excludes)
    if rtypes is not None and rtypes <= {"string"}:
        return True, _raw_text(where, resolved, root, excludes, untyped=True)
    raise ValueError(f"{where}: GLM's parser reads a value whose schema shows no type (a $ref?) as JSON "
                     "when it parses as JSON, else as text; give the property an explicit type")


def _kv_arguments(family: str, fn: str, params: dict[str, Any], excludes: tuple[str, ...]) -> list[Format]:
    """The argument pairs of one call, in schema order: required ones always, optional ones maybe."""
    props: dict[str, Any] = dict(params.get("properties") or {})
    required = params.get("required") or []
    for key in required:
        props.setdefault(key, {})
    nl = _opt(_const("\n"))
    out = []
    for key, prop in props.items():
        if prop is False:
            continue
        if family == "glm45":
            if "<" in key or key != key.strip() or not key:
                raise ValueError(f"tool {fn!r}: property name {key!r} cannot be written as a GLM arg_key")
        elif '"' in key or ">" in key or not key:
            raise ValueError(f"tool {fn!r}: property name {key!r} cannot be written as a DSML parameter")
        raw, content = _kv_value(family, fn, key, prop, params, excludes)
        if family == "glm45":
            value = _tag("<arg_value>", content, "</arg_value>")
            pair = _seq(nl, _const(f"<arg_key>{key}</arg_key>"), nl, value)
        else:
            begin = f'<{_DSML}parameter name="{key}" string="{"true" if raw else "false"}">'
            pair = _seq(nl, _tag(begin, content, f"</{_DSML}parameter>"))
        out.append(pair if key in required else _opt(pair))
    return out


# -- the formats -----------------------------------------------------------------------------------


def _deepseek_v3(functions: list[tuple[str, dict[str, Any]]], single: bool) -> Format:
    calls = [_tag(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n", _json(p, _DS_JSON_TOKENS),
                  "\n```<｜tool▁call▁end｜>") for name, p in functions]
    sep = None if single else _opt(_const("\n"))
    return _seq(_const("<｜tool▁calls▁begin｜>"), _calls(calls, single, sep), _const("<｜tool▁calls▁end｜>"))


def _deepseek_v31(functions: list[tuple[str, dict[str, Any]]], single: bool) -> Format:
    calls = [_tag(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", _json(p, _DS_JSON_TOKENS),
                  "<｜tool▁call▁end｜>") for name, p in functions]
    return _seq(_const("<｜tool▁calls▁begin｜>"), _calls(calls, single), _const("<｜tool▁calls▁end｜>"))


def _kimi_k2(functions: list[tuple[str, dict[str, Any]]], single: bool) -> Format:
    calls = [
        _tag(f"<|tool_call_begin|>functions.{name}:",
             _seq(_regex(KIMI_INDEX), _const("<|tool_call_argument_begin|>"), _json(p, _KIMI_TOKENS)),
             "<|tool_call_end|>")
        for name, p in functions
    ]
    return _seq(_const("<|tool_calls_section_begin|>"), _calls(calls, single),
                _const("<|tool_calls_section_end|>"))


def _glm45(functions: list[tuple[str, dict[str, Any]]], single: bool) -> Format:
    calls = [_seq(_const(f"<tool_call>{name}"), *_kv_arguments("glm45", name, p, _GLM_TOKENS),
                  _opt(_const("\n")), _const("</tool_call>")) for name, p in functions]
    return _calls(calls, single, _opt(_const("\n")))


def _deepseek_v32(functions: list[tuple[str, dict[str, Any]]], single: bool) -> Format:
    calls = [_seq(_const(f'<{_DSML}invoke name="{name}">'),
                  *_kv_arguments("deepseekv32", name, p, _DSML_TOKENS),
                  _opt(_const("\n")), _const(f"</{_DSML}invoke>")) for name, p in functions]
    nl = _opt(_const("\n"))
    return _seq(_opt(_const("\n\n")), _const(f"<{_DSML}function_calls>"), _calls(calls, single, nl), nl,
                _const(f"</{_DSML}function_calls>"))


_FAMILIES = {
    "deepseekv3": _deepseek_v3,
    "deepseekv31": _deepseek_v31,
    "deepseekv32": _deepseek_v32,
    "glm45": _glm45,
    "kimi_k2": _kimi_k2,
}
