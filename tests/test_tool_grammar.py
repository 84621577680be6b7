"""splash/chat/tool_grammar.py: the structural tags that force a tool call (tool_choice "required" and
named), checked against the parsers of splash/chat.

For each format and choice kind: the example outputs (written as the chat templates and the parsers'
docstrings lay them out) are accepted; a wrong function name, a missing required argument, a wrong
type, a value over its length, a special token inside a value, an extra argument, two calls where one
is allowed, and no call at all are rejected; and random generation (a matcher driven by uniformly random
choices among the allowed tokens of a small byte-level BPE vocabulary holding each family's special
tokens, compiled as the engine compiles it) always ends in text the family's parser reads as calls,
with no leftover content, whose arguments validate against the tool's schema.
"""

from __future__ import annotations

import codecs
import itertools
import json
import random
import re
import subprocess
import sys
from typing import Any

import pytest

from splash.chat import TOOL_PARSERS, tool_parser
from splash.chat.base import schema_types
from splash.chat.tool_grammar import tool_call_structural_tag

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

FAMILIES = ["deepseekv3", "deepseekv31", "kimi_k2", "glm45", "deepseekv32"]
DSML = "｜DSML｜"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12, "description": "the city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "label": {"type": ["string", "null"], "maxLength": 6},
                "loud": {"type": "boolean"},
                "days": {"type": "array", "items": {"type": "string", "enum": ["mon", "tue"]}, "maxItems": 3},
                "snooze": {"type": "object", "properties": {"minutes": {"type": "integer", "maximum": 30},
                                                            "on": {"type": "boolean"}},
                           "required": ["on"]},
            },
            "required": ["hour", "loud"],
        },
    },
}
SEARCH = {  # bare function dict (no {"type": "function"} wrapper), $defs and $ref, pattern, minLength
    "name": "search",
    "parameters": {
        "type": "object",
        "$defs": {"Lang": {"type": "string", "enum": ["en", "fr"]}},
        "properties": {
            "query": {"type": "string", "minLength": 2, "maxLength": 8},
            "lang": {"$ref": "#/$defs/Lang"},
            "code": {"type": "string", "pattern": "[A-Z]{3}"},
            "score": {"type": "number"},
        },
        "required": ["query", "lang"],
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "No arguments."}}
TOOLS = [WEATHER, ALARM, SEARCH, PING]


def params_of(name: str) -> dict:
    for t in TOOLS:
        fn = t.get("function", t)
        if fn["name"] == name:
            return fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", "properties": {}}  # an unknown tool: its values written as JSON


# -- rendering calls as the chat templates and the parser docstrings lay them out ------------------


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _kv_raw(family: str, prop: Any, value: Any, root: dict) -> bool:
    """Whether a key/value format writes `value` as raw text (else JSON), as the grammar expects."""
    if not isinstance(value, str):
        return False
    types = schema_types(prop)
    if types is None and isinstance(prop, dict) and "$ref" in prop:
        return True  # a $ref to a string enum (the only kind the test tools use)
    return types is not None and types <= {"string"}


def render(family: str, calls: list[tuple[str, dict]], compact: bool = False) -> str:
    """A tool section with `calls` [(name, arguments)] in `family`'s layout (GLM-4.7's when compact)."""
    if family == "deepseekv3":
        body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{dumps(a)}\n```"
                         "<｜tool▁call▁end｜>" for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if family == "deepseekv31":
        body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{dumps(a)}<｜tool▁call▁end｜>"
                       for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if family == "kimi_k2":
        body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{dumps(a)}"
                       "<|tool_call_end|>" for i, (n, a) in enumerate(calls))
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    out = []
    for n, a in calls:
        root = params_of(n)
        props = root.get("properties", {})
        if n not in GOOD:  # (a misspelt name: write the values as its namesake would)
            props = params_of("get_weather")["properties"]
        pieces = []
        for k, v in a.items():
            raw = _kv_raw(family, props.get(k, {}), v, root)
            text = v if raw else dumps(v)
            if family == "glm45":
                nl = "" if compact else "\n"
                pieces.append(f"<arg_key>{k}</arg_key>{nl}<arg_value>{text}</arg_value>")
            else:
                pieces.append(f'<{DSML}parameter name="{k}" string="{"true" if raw else "false"}">{text}'
                              f"</{DSML}parameter>")
        if family == "glm45":
            nl = "" if compact else "\n"
            out.append(f"{nl}<tool_call>{n}{nl}" + nl.join(pieces) + (nl if pieces else "") + "</tool_call>")
        else:
            params = "".join(p + "\n" for p in pieces)
            out.append(f'<{DSML}invoke name="{n}">\n{params}</{DSML}invoke>')
    if family == "glm45":
        return "".join(out)
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(out) + f"\n</{DSML}function_calls>"


# -- a JSON-schema check for the test tools' schemas (jsonschema is not a dependency) --------------


def validate(value: Any, schema: Any, root: dict) -> list[str]:
    """Errors of `value` against `schema` (the subset of JSON Schema the test tools use)."""
    if schema is True or schema == {}:
        return []
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return validate(value, target, root)
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
             type(None): "null"}
    kind = kinds[type(value)]
    errs = []
    t = schema.get("type")
    if t is not None:
        allowed = {t} if isinstance(t, str) else set(t)
        if not (kind in allowed or (kind == "integer" and "number" in allowed)):
            return [f"{value!r} is {kind}, not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{value!r} not in {schema['enum']}")
    if kind == "string":
        if len(value) > schema.get("maxLength", 1 << 30) or len(value) < schema.get("minLength", 0):
            errs.append(f"{value!r}: length out of range")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errs.append(f"{value!r} does not match {schema['pattern']}")
    if kind in ("integer", "number"):
        if value < schema.get("minimum", float("-inf")) or value > schema.get("maximum", float("inf")):
            errs.append(f"{value!r} out of range")
    if kind == "array":
        if len(value) > schema.get("maxItems", 1 << 30):
            errs.append(f"{value!r}: too many items")
        for v in value:
            errs += validate(v, schema.get("items", {}), root)
    if kind == "object":
        props = schema.get("properties", {})
        errs += [f"missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += validate(v, props[k], root)
            elif schema.get("additionalProperties", True) is False or props:
                errs.append(f"unexpected argument {k!r}")  # the grammar writes declared properties only
    return errs


GOOD = {
    "get_weather": {"city": "Paris", "unit": "celsius", "days": 3},
    "set_alarm": {"hour": 7, "label": "wake", "loud": True, "days": ["mon"],
                  "snooze": {"minutes": 5, "on": False}},
    "search": {"query": "cats", "lang": "fr", "code": "ABC", "score": 0.5},
    "ping": {},
}


def test_good_examples_are_valid_and_parse():
    """The fixtures themselves: GOOD validates, and every rendering parses back to it."""
    for name, args in GOOD.items():
        assert validate(args, params_of(name), params_of(name)) == []
    for family in FAMILIES:
        for compact in (False, True):
            text = render(family, list(GOOD.items()), compact)
            content, calls = tool_parser(family).extract(text, TOOLS)
            assert content == "", (family, text)
            assert [(c.name, json.loads(c.arguments)) for c in calls] == list(GOOD.items()), (family, text)


# -- string-level acceptance -----------------------------------------------------------------------

_GRAMMARS: dict[tuple, Any] = {}


def grammar(family: str, choice: Any = "required", parallel: bool = True, tools: list | None = None) -> Any:
    key = (family, json.dumps(choice), parallel, json.dumps(tools))
    if key not in _GRAMMARS:
        text = tool_call_structural_tag(family, TOOLS if tools is None else tools, choice, parallel)
        _GRAMMARS[key] = xgr.Grammar.from_structural_tag(text)
    return _GRAMMARS[key]


def accepts(family: str, text: str, choice: Any = "required", parallel: bool = True) -> bool:
    return _is_grammar_accept_string(grammar(family, choice, parallel), text)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("family", FAMILIES)
def test_examples_accepted(family):
    for name, args in GOOD.items():
        for compact in (False, True):
            one = render(family, [(name, args)], compact)
            assert accepts(family, one), one
            assert accepts(family, one, parallel=False), one
            assert accepts(family, one, named(name)), one
    minimal = {"get_weather": {"city": "Oslo"}, "set_alarm": {"hour": 0, "loud": False},
               "search": {"query": "ab", "lang": "en"}}
    for name, args in minimal.items():
        assert accepts(family, render(family, [(name, args)]))
    assert accepts(family, render(family, list(GOOD.items())))
    assert accepts(family, render(family, [("ping", {}), ("ping", {})]))


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_calls_rejected(family):
    w = GOOD["get_weather"]
    bad = {
        "wrong name": [("get_wether", w)],
        "missing required": [("get_weather", {"unit": "celsius"})],
        "wrong type": [("get_weather", {"city": "Paris", "days": "three"})],
        "integer over its maximum": [("get_weather", {"city": "Paris", "days": 15})],
        "not in enum": [("get_weather", {"city": "Paris", "unit": "kelvin"})],
        "string over maxLength": [("get_weather", {"city": "Llanfairpwllgwyngyll"})],
        "string under minLength": [("search", {"query": "a", "lang": "en"})],
        "pattern": [("search", {"query": "ab", "lang": "en", "code": "abc"})],
        "$ref enum": [("search", {"query": "ab", "lang": "de"})],
        "boolean as string": [("set_alarm", {"hour": 1, "loud": "yes"})],
        "nested required": [("set_alarm", {"hour": 1, "loud": True, "snooze": {"minutes": 3}})],
        "extra argument": [("get_weather", {"city": "Paris", "country": "FR"})],
        "argument to ping": [("ping", {"x": 1})],
    }
    for what, calls in bad.items():
        text = render(family, calls)
        assert not accepts(family, text), (what, text)
    good = render(family, [("get_weather", w)])
    assert not accepts(family, ""), "no call"
    assert not accepts(family, "The weather is fine."), "plain text"
    assert not accepts(family, "Sure. " + good), "content before the call"
    assert not accepts(family, good + " Done."), "content after the call"
    assert not accepts(family, render(family, [])), "an empty tool section"
    two = render(family, [("get_weather", w), ("ping", {})])
    assert accepts(family, two)
    assert not accepts(family, two, parallel=False), "two calls, parallel off"
    assert not accepts(family, two, named("get_weather")), "two calls, named"
    assert not accepts(family, render(family, [("ping", {})]), named("get_weather")), "not the named tool"
    assert accepts(family, render(family, [("ping", {})]), named("ping"))


FREE = [{"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "meta": {"type": "object"}}, "required": ["text"]}}]
DS_MARKERS = ["<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜end▁of▁sentence｜>"]
MARKERS = {
    "deepseekv3": DS_MARKERS,
    "deepseekv31": DS_MARKERS,
    "kimi_k2": ["<|tool_call_end|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|im_end|>"],
    "glm45": ["</arg_value>", "<arg_key>", "</tool_call>", "<tool_call>", "<|user|>"],
    "deepseekv32": [f"</{DSML}parameter>", f"<{DSML}parameter", f"</{DSML}invoke>",
                    f"</{DSML}function_calls>", "<｜end▁of▁sentence｜>"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_free_text_and_special_tokens(family):
    """Unbounded strings take any text (quotes, newlines, `<`) but no special token that would cut the
    value short in the parser, in the raw value and in nested JSON strings alike."""
    g = grammar(family, tools=FREE)
    args = {"text": 'x < y, "quoted" \\ and\nnew lines </b>', "meta": {"a": [1, "</arg_value", "<|"]}}
    text = _render_free(family, args)
    assert _is_grammar_accept_string(g, text), text
    content, calls = tool_parser(family).extract(text, FREE)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [args]
    for m in MARKERS[family]:
        text = _render_free(family, {"text": "a" + m + "b", "meta": {}})
        assert not _is_grammar_accept_string(g, text), text
        text = _render_free(family, {"text": "a", "meta": {"k": [m]}})
        assert not _is_grammar_accept_string(g, text), text
    # strings with a maxLength (raw or JSON) are `[^<]{min,max}`: no `<` at all
    assert accepts(family, render(family, [("get_weather", {"city": "a>b 'c' é😀"})]))
    assert not accepts(family, render(family, [("get_weather", {"city": "a<b"})]))
    assert not accepts(family, render(family, [("set_alarm", {"hour": 1, "label": "a<b", "loud": True})]))
    assert accepts(family, render(family, [("set_alarm", {"hour": 1, "label": None, "loud": True})]))


def _render_free(family: str, args: dict) -> str:
    if family in ("deepseekv3", "deepseekv31", "kimi_k2"):
        return render(family, [("note", args)])
    if family == "glm45":
        return (f"<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>{args['text']}</arg_value>\n"
                f"<arg_key>meta</arg_key>\n<arg_value>{dumps(args['meta'])}</arg_value>\n</tool_call>")
    return (f'<{DSML}function_calls>\n<{DSML}invoke name="note">\n<{DSML}parameter name="text" string="true">'
            f'{args["text"]}</{DSML}parameter>\n<{DSML}parameter name="meta" string="false">'
            f"{dumps(args['meta'])}</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}function_calls>")


def test_aliases_and_errors():
    for alias, cls in TOOL_PARSERS.items():
        assert tool_call_structural_tag(alias, TOOLS) == tool_call_structural_tag(cls.name, TOOLS)
    st = json.loads(tool_call_structural_tag("glm", TOOLS, named("ping"), parallel=True))
    assert st["type"] == "structural_tag" and "format" in st
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_call_structural_tag("qwen25", TOOLS)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_structural_tag("glm45", TOOLS, named("get_time"))
    with pytest.raises(ValueError, match="function.name"):
        tool_call_structural_tag("glm45", TOOLS, {"type": "function"})
    with pytest.raises(ValueError, match="not enforced"):
        tool_call_structural_tag("glm45", TOOLS, "auto")
    with pytest.raises(ValueError, match="non-empty list of tools"):
        tool_call_structural_tag("glm45", [])
    with pytest.raises(ValueError, match="object schema"):
        tool_call_structural_tag("kimi_k2", [{"name": "f", "parameters": {"type": "array"}}])
    with pytest.raises(ValueError, match="must be a JSON schema object"):
        tool_call_structural_tag("kimi_k2", [{"name": "f", "parameters": "x"}])
    with pytest.raises(ValueError, match="no function name"):
        tool_call_structural_tag("kimi_k2", [{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="cannot be written"):
        tool_call_structural_tag("deepseekv32", [{"name": 'a"b'}])
    with pytest.raises(ValueError, match="two tools"):
        tool_call_structural_tag("deepseekv3", [PING, PING])
    untyped = {"name": "f", "parameters": {"type": "object", "$defs": {"S": {"type": "string"}},
                                           "properties": {"s": {"$ref": "#/$defs/S"}}}}
    with pytest.raises(ValueError, match="explicit type"):
        tool_call_structural_tag("glm45", [untyped])
    tool_call_structural_tag("deepseekv32", [untyped])  # DSML's string="true" says it is a string


def test_standard_library_only():
    code = ("import sys, splash.chat; before = set(sys.modules); import splash.chat.tool_grammar; "
            "new = set(sys.modules) - before; "
            "print(sorted(k for k in new if k != 'splash.chat.tool_grammar'), "
            "[k for k in sys.modules if k.split('.')[0] in ('xgrammar', 'torch', 'pydantic')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"


# -- random generation with a real tokenizer vocabulary --------------------------------------------

SPECIALS = [
    "<eos>",
    "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
    "<|tool_call_argument_begin|>", "<|im_end|>",
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|user|>",
    "<|observation|>", "<|endoftext|>",
    # DSML's tags (text in DeepSeek-V3.2's vocabulary; single tokens here, so that random free text ends)
    f"<{DSML}function_calls>", f"</{DSML}function_calls>", f"<{DSML}invoke", f"</{DSML}invoke>",
    f"<{DSML}parameter", f"</{DSML}parameter>",
]


@pytest.fixture(scope="module")
def vocab():
    """(TokenizerInfo, GrammarCompiler) of a byte-level BPE tokenizer (about 600 tokens: the 256
    bytes, merges learnt from the example outputs, the families' special tokens, "<eos>" to stop)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=SPECIALS)
    corpus = [render(f, list(GOOD.items()), c) for f in FAMILIES for c in (False, True)] * 4
    tok.train_from_iterator(corpus, trainer)
    table = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * len(table)
    for text, i in table.items():
        encoded[i] = text
    eos = table["<eos>"]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=len(encoded), stop_token_ids=[eos])
    assert encoded.count("") == 0 and len(encoded) > 400
    return info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)


def completable(tail: bytes) -> bool:
    """Whether an unfinished UTF-8 character can still be finished (Python's incremental decoder lets
    some dead starts through, such as a surrogate's first two bytes)."""
    for k in range(4):
        for rest in itertools.product((0x80, 0x8F, 0x9F, 0xA0, 0xBF), repeat=k):
            try:
                (tail + bytes(rest)).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


def random_output(compiled: Any, info: Any, rng: random.Random, limit: int = 4000) -> str:
    """Drive a matcher with uniformly random allowed tokens until it accepts the stop token.

    The random model writes valid UTF-8 only (a token that would make the bytes invalid is passed
    over): xgrammar's character classes, its own JSON strings included, take any lead byte with its
    continuation bytes as a character (overlong forms and encoded surrogates too), which no trained
    model writes and a detokenizer would turn into U+FFFD."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    out = bytearray()
    pending = b""  # the bytes of an unfinished UTF-8 character
    decoded = info.decoded_vocab
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = ((bitmask[0].unsqueeze(1) >> shifts) & 1).flatten()[: info.vocab_size].nonzero().flatten()
        candidates = allowed.tolist()
        while True:
            assert candidates, f"only invalid UTF-8 allowed after {bytes(out)!r}"
            token = candidates.pop(rng.randrange(len(candidates)))
            try:
                _, used = codecs.utf_8_decode(pending + decoded[token], "strict", False)
            except UnicodeDecodeError:
                continue
            if completable((pending + decoded[token])[used:]):
                break
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token in info.stop_token_ids and not pending
            return out.decode("utf-8")
        pending = (pending + decoded[token])[used:]
        out += decoded[token]
    raise AssertionError(f"no end after {limit} tokens: {out.decode('utf-8', 'replace')[:400]!r}")


CHOICES = [("required", True), ("required", False), (named("get_weather"), True), (named("set_alarm"), True),
           (named("search"), False), (named("ping"), True)]


@pytest.mark.parametrize("family", FAMILIES)
def test_random_generation_parses_and_validates(family, vocab):
    info, compiler = vocab
    seen: set[str] = set()
    counts: set[int] = set()
    for ci, (choice, parallel) in enumerate(CHOICES):
        compiled = compiler.compile_structural_tag(tool_call_structural_tag(family, TOOLS, choice, parallel))
        single = choice != "required" or not parallel
        for seed in range(30 if choice == "required" else 10):
            rng = random.Random(1000 * ci + seed)
            text = random_output(compiled, info, rng)
            content, calls = tool_parser(family).extract(text, TOOLS)
            assert content.strip() == "", (family, text)
            assert calls and (len(calls) == 1 or not single), (family, text)
            counts.add(len(calls))
            for call in calls:
                if choice != "required":
                    assert call.name == choice["function"]["name"], text
                args = json.loads(call.arguments)
                root = params_of(call.name)
                assert validate(args, root, root) == [], (family, text, args)
                if family == "kimi_k2":
                    assert re.fullmatch(rf"functions\.{call.name}:\d+", call.id), call.id
                seen.add(call.name)
    assert seen == {"get_weather", "set_alarm", "search", "ping"}
    assert max(counts) > 1  # parallel calls happen


NOTE = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "title": {"type": "string", "minLength": 3}}, "required": ["text"]}}}]


@pytest.mark.parametrize("family", FAMILIES)
def test_random_free_text(family, vocab):
    """Unbounded strings: random text (special tokens excluded) until the closing tag or quote."""
    info, compiler = vocab
    compiled = compiler.compile_structural_tag(tool_call_structural_tag(family, NOTE, parallel=False))
    for seed in range(8):
        text = random_output(compiled, info, random.Random(seed), limit=20000)
        content, calls = tool_parser(family).extract(text, NOTE)
        assert content.strip() == "" and len(calls) == 1, text
        args = json.loads(calls[0].arguments)
        assert isinstance(args["text"], str) and len(args.get("title", "abc")) >= 3, text
