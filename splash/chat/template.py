"""Chat templates rendered the way transformers renders them (written from reading transformers 5's
`utils/chat_template_utils.py` and `PreTrainedTokenizerBase.apply_chat_template`), so a checkpoint's
Jinja template gives the same prompt text here as `AutoTokenizer.apply_chat_template` does.

The environment matches transformers': a sandboxed, immutable jinja2 environment with `trim_blocks` and
`lstrip_blocks`, `{% break %}` / `{% continue %}`, a `{% generation %}` block (rendered as its body), a
`tojson` filter that leaves non-ASCII and HTML characters alone, `raise_exception`, `strftime_now`, and
the `dict` / `namespace` globals (a namespace refuses underscore names). The template sees `messages`
(plain data, keys whose value is None dropped, reasoning copied under `reasoning_content` and
`thinking`), `tools` (the JSON schemas as given: OpenAI's `{"type": "function", "function": {...}}`),
`documents`, `add_generation_prompt`, the special tokens and any extra variables.

One step comes from transformers' server (`transformers serve`, as vLLM and SGLang do too) rather than
its `apply_chat_template`: an assistant's `tool_calls[].function.arguments` sent as a JSON string (the
OpenAI shape) reaches the template parsed, since templates iterate the arguments as a mapping
(`arguments | items`) or dump them with `tojson`. Arguments that are not valid JSON stay a string
(SGLang's choice), so the template decides what to do with them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning arrives under; templates read the first (gpt-oss ones read "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message for continue_final_message, then the text is cut where it shows up.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Variables render() itself sets; extra template variables may not replace them.
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplateError(ValueError):
    """A chat template rejected the conversation (its `raise_exception`), does not compile, or failed while
    rendering it; the message says which. A ValueError, so the server answers 400."""


# ---- the environment ----------------------------------------------------------------------------
def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: json.dumps with its options; no HTML escaping (Jinja's own escapes <, >, &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)`; like transformers', it refuses underscore-prefixed names (no reaching CPython
    internals through `{% set ns.__x__ = ... %}`)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's trick: namespace(self=...) works)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the underscore-prefixed name {name!r} on a namespace")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which training templates use to mark assistant tokens:
    here (as in transformers when no mask is asked for) it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=64)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached by its text)."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template does not compile (line {e.lineno}): {e.message}") from None


# ---- what the template sees ---------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A fresh copy of `value` in plain JSON-like types (transformers rebuilds every input so): mappings,
    lists, tuples and scalars; pydantic models and dataclasses as dicts; anything else as "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _parse_arguments(message: dict[str, Any]) -> None:
    """An assistant's tool calls with JSON-string arguments get them parsed (in place, on our copy)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return
    for call in calls:
        fn = (call.get("function") or call) if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # left as sent


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation as templates get it: a fresh list of plain dicts, each without the keys whose value
    is None (OpenAI clients send `content: null`, `tool_calls: null`), reasoning under all of
    REASONING_FIELDS' first two names (transformers' aliasing: `thinking` kept if given), and tool-call
    arguments parsed from JSON strings."""
    messages = getattr(messages, "messages", messages)
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    out = []
    for i, m in enumerate(_plain(list(messages))):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        _parse_arguments(m)
        out.append(m)
    return out


def _tag_final_message(template: str, messages: list[dict[str, Any]], field: str) -> str:
    """Append the continue tag to the final message's `field` (every copy of it, for reasoning); return
    the text being continued. transformers' checks: the field is present and the template reads it."""
    last = messages[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(
            f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [field]
    if field in REASONING_FIELDS:
        fields = [f for f in REASONING_FIELDS if last.get(f) == final]
    if not any(f in template for f in fields):
        raise ChatTemplateError(
            f"continue_final_message is set to {field!r} but the chat template never reads that field")
    if isinstance(final, (list, tuple)):  # content parts: continue the last text part
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    if not isinstance(final, str):
        raise ChatTemplateError(f"continue_final_message: the final message's {field!r} is not text")
    for f in fields:
        last[f] = last[f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    """The rendered text up to the final message's end, where the tag shows up (transformers' cut)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat (the "
            "chat template drops or changes part of it)")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render(template: str, messages: Any, *, tools: list[dict[str, Any]] | None = None,
           documents: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool | str = False, bos_token: str | None = None,
           eos_token: str | None = None, **template_kwargs: Any) -> str:
    """The prompt text of `messages` under the Jinja chat `template`, as transformers renders it.

    `tools`: JSON schemas (dicts) as given; `documents`: dicts. `continue_final_message` (True for
    "content", or the name of the field, e.g. "reasoning_content") leaves the final message open: the text
    is cut right after its content, so no end-of-turn follows; it cannot go with `add_generation_prompt`.
    `bos_token` / `eos_token` (and any special token given in `template_kwargs`) reach the template when
    set; the other `template_kwargs` are template variables (chat_template_kwargs such as
    `enable_thinking`). Raises ChatTemplateError when the template rejects the conversation."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be set: continue_final_message "
            "continues the final message, add_generation_prompt opens a new assistant turn")
    reserved = [k for k in _RESERVED if k in template_kwargs]
    if reserved:
        raise ChatTemplateError(f"template variables may not set {', '.join(reserved)}")
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be a list of JSON schemas (dicts)")
        tools = _plain(list(tools))
    if documents is not None:
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be a list of dicts (with 'title' and 'text')")
        documents = _plain(list(documents))
    specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    variables = _plain({**specials, **template_kwargs})
    compiled = compile_template(template)
    msgs = normalize_messages(messages)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(template, msgs, field)
    try:
        text = compiled.render(messages=msgs, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except Exception as e:  # the template's own operations (a str plus an int, a bad index, ...)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    return text if final is None else _cut_at_tag(text, final)


# ---- --chat-template ----------------------------------------------------------------------------
def resolve_chat_template(value: str) -> str:
    """`--chat-template FILE|STRING`: the text of a template file (.jinja, .j2, .txt, ...), or `value`
    itself when it is a Jinja template (holds `{{` or `{%`); checked to compile. A ChatTemplateError
    otherwise (no such file, unreadable, empty, not a template)."""
    if not isinstance(value, str) or not value.strip():
        raise ChatTemplateError("--chat-template is empty; give a template file or the template text")
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"--chat-template {value!r} cannot be read: {e}") from None
        if not text.strip():
            raise ChatTemplateError(f"--chat-template file {value!r} is empty")
    elif "{{" in value or "{%" in value:
        text = value
    elif os.path.isdir(value):
        raise ChatTemplateError(f"--chat-template {value!r} is a directory; give the template file in it")
    else:
        raise ChatTemplateError(
            f"--chat-template {value!r} is no file and no Jinja template (it holds no '{{{{' or '{{%'); "
            "give a path to a .jinja file or the template text")
    compile_template(text)
    return text
