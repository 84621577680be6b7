"""splash/chat: tool-call parsers, reasoning parsers and DeepSeek-V3.2's chat encoding.

The tool-call texts are the example outputs the peers document for each format: SGLang's detector
docstrings (python/sglang/srt/function_call/deepseekv3_detector.py, deepseekv31_detector.py,
glm4_moe_detector.py, glm47_moe_detector.py; kimik2_detector.py gives Kimi's format, filled in here),
vLLM's DeepSeekV32ToolParser docstring, and DeepSeek-V3.2's own encoding/tests output (the DSML block).
Every one is parsed whole and streamed in chunks of 1, 3 and 7 characters, and the deltas must rebuild
the same content and calls.

The DeepSeek-V3.2 prompts are written out by hand from reading the official encoder,
encoding/encoding_dsv32.py in deepseek-ai/DeepSeek-V3.2 (encode_messages with thinking_mode "chat" or
"thinking", drop_thinking=True); the thinking example is the one in that repository's README.
"""

from __future__ import annotations

import json
import re

import pytest

from splash.chat import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    DeepSeekV32ToolParser,
    Glm45ToolParser,
    ToolCall,
    ToolCallDelta,
    dsv32,
    reasoning_parser,
    thinking_from_kwargs,
    tool_parser,
)


def fn(name: str, **props: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in props.items()}},
        },
    }


TOOLS = [
    fn("get_current_weather", location="string"),
    fn("get_weather", city="string", date="string", location="string"),
    fn("get_datetime", timezone="string"),
    fn("search", query="string", limit="integer", exact="boolean", filters="object", tags="array"),
]

TC, TCB, SEP, TCE, TCSE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
EOS = "<｜end▁of▁sentence｜>"
V3 = (
    f'{TC}{TCB}function{SEP}get_current_weather\n```json\n{{"location": "Tokyo"}}\n```{TCE}\n'
    f'{TCB}function{SEP}get_current_weather\n```json\n{{"location": "Paris"}}\n```{TCE}{TCSE}{EOS}'
)
V31 = (
    f'{TC}{TCB}get_current_weather{SEP}{{"location": "Tokyo"}}{TCE}'
    f'{TCB}get_current_weather{SEP}{{"location": "Paris"}}{TCE}{TCSE}{EOS}'
)
D = "｜DSML｜"
V32 = (
    f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="location" string="true">杭州</{D}parameter>\n'
    f'<{D}parameter name="date" string="true">2024-01-16</{D}parameter>\n</{D}invoke>\n'
    f'<{D}invoke name="get_weather">\n<{D}parameter name="location" string="true">北京</{D}parameter>\n'
    f'<{D}parameter name="date" string="true">2024-01-16</{D}parameter>\n</{D}invoke>\n</{D}function_calls>'
)
V32_OFFICIAL = (
    f'\n\n<{D}function_calls>\n<{D}invoke name="get_datetime">\n'
    f'<{D}parameter name="timezone" string="true">America/New_York</{D}parameter>\n'
    f"</{D}invoke>\n</{D}function_calls>{EOS}"
)
GLM45 = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
    "<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>"
)
GLM47 = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value><arg_key>date</arg_key>"
    "<arg_value>2024-06-27</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key>"
    "<arg_value>上海</arg_value><arg_key>date</arg_key><arg_value>2024-06-27</arg_value></tool_call>"
)
KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
    '<|tool_call_argument_begin|>{"city": "Shanghai"}<|tool_call_end|><|tool_calls_section_end|>'
)

TOKYO, PARIS = ("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "Paris"})
BJ, SH = (
    ("get_weather", {"city": "北京", "date": "2024-06-27"}),
    ("get_weather", {"city": "上海", "date": "2024-06-27"}),
)
CASES = [  # parser, text, expected content, expected (name, arguments) calls
    ("deepseekv3", V3, "", [TOKYO, PARIS]),
    ("deepseekv3", "Let me check.\n\n" + V3, "Let me check.", [TOKYO, PARIS]),
    ("deepseekv31", V31, "", [TOKYO, PARIS]),
    ("deepseekv31", "Checking both." + V31, "Checking both.", [TOKYO, PARIS]),
    (
        "deepseekv32",
        V32,
        "",
        [
            ("get_weather", {"location": "杭州", "date": "2024-01-16"}),
            ("get_weather", {"location": "北京", "date": "2024-01-16"}),
        ],
    ),
    (
        "deepseekv32",
        "I need the date first." + V32_OFFICIAL,
        "I need the date first.",
        [("get_datetime", {"timezone": "America/New_York"})],
    ),
    ("glm45", GLM45, "", [BJ]),
    ("glm45", "我来查一下。\n" + GLM45 + "\n" + GLM45.replace("北京", "上海"), "我来查一下。", [BJ, SH]),
    ("glm47", GLM47, "", [BJ, SH]),
    ("kimi_k2", KIMI, "", [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})]),
    (
        "kimi_k2",
        "Let me look both up." + KIMI,
        "Let me look both up.",
        [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})],
    ),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def stream(name: str, text: str, chunk: int, tools=TOOLS, **kw) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed `text` in `chunk`-sized pieces; rebuild content and (id, name, arguments) per call, checking
    that only a call's first delta carries its id and name."""
    p = tool_parser(name)(tools, **kw)
    deltas = []
    for i in range(0, len(text), chunk):
        deltas += p.feed(text[i : i + chunk])
    deltas += p.finish()
    content, calls = "", {}
    for d in deltas:
        if isinstance(d, str):
            content += d
        elif d.index not in calls:
            assert d.id and d.name and d.arguments == "", d
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None, d
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_extract_documented_examples(case):
    name, text, content, expected = case
    got_content, calls = tool_parser(name).extract(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    for c in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id) or re.fullmatch(rf"functions\.{c.name}:\d+", c.id)


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stream_rebuilds_extract(case, chunk):
    name, text, _, _ = case
    content, calls = tool_parser(name).extract(text, TOOLS)
    s_content, s_calls = stream(name, text, chunk)
    assert s_content == content
    assert [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in calls]
    if name == "kimi_k2":
        assert (
            [i for i, _, _ in s_calls]
            == [c.id for c in calls]
            == ["functions.get_weather:0", "functions.get_weather:1"]
        )


TRIGGERS = {
    "deepseekv3": TC,
    "deepseekv31": TC,
    "deepseekv32": f"<{D}function_calls>",
    "glm45": "<tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|>",
}


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_partial_special_token_is_held_back(name):
    tok = TRIGGERS[name]
    p = tool_parser(name)(TOOLS)
    assert p.feed("Hello " + tok[: len(tok) // 2]) == ["Hello"]
    assert p.feed(tok[len(tok) // 2 :]) == []
    p = tool_parser(name)(TOOLS)  # a false alarm is released as content
    assert "".join(p.feed("a " + tok[:3]) + p.feed("b") + p.finish()) == "a " + tok[:3] + "b"


CUT = {  # a response cut off in the middle of a call's arguments
    "deepseekv3": f'Hi. {TC}{TCB}function{SEP}get_weather\n```json\n{{"city": "Par',
    "deepseekv31": f'Hi. {TC}{TCB}get_weather{SEP}{{"city": "Par',
    "deepseekv32": f'Hi. <{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" str',
    "glm45": "Hi. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
    "kimi_k2": "Hi. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Par',
}
GARBAGE = {
    "deepseekv3": f"Hi. {TC}oops",
    "deepseekv31": f"Hi. {TC}{TCB}get_weather but no separator",
    "deepseekv32": f"Hi. <{D}function_calls>\nnot an invoke",
    "glm45": "Hi. <tool_call>get_weather",
    "kimi_k2": "Hi. <|tool_calls_section_begin|>plain words",
}


@pytest.mark.parametrize("name", sorted(CUT))
def test_malformed_sections_come_back_as_content(name):
    content, calls = tool_parser(name).extract(CUT[name], TOOLS)
    assert (content, calls) == (CUT[name], [])  # cut off after the name: extract gives the text back
    for chunk in (1, 3, 7):  # a stream already announced the call; it must still not raise
        s_content, s_calls = stream(name, CUT[name], chunk)
        assert s_content == "Hi." and [n for _, n, _ in s_calls] == ["get_weather"]
        # broken before any name: the text is content, whole or streamed
        assert tool_parser(name).extract(GARBAGE[name], TOOLS) == (GARBAGE[name], [])
        assert stream(name, GARBAGE[name], chunk) == (GARBAGE[name], [])


def test_bad_json_call_is_dropped_and_kept_as_content():
    text = f'{TC}{TCB}get_weather{SEP}{{bad json}}{TCE}{TCB}get_weather{SEP}{{"city": "Oslo"}}{TCE}{TCSE}'
    content, calls = tool_parser("deepseekv31").extract(text, TOOLS)
    assert "{bad json}" in content and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]


UNKNOWN = {
    "deepseekv31": f'{TC}{TCB}rm_rf{SEP}{{"path": "/"}}{TCE}'
    f'{TCB}get_weather{SEP}{{"city": "Oslo"}}{TCE}{TCSE}',
    "glm45": "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
    "deepseekv32": f'<{D}function_calls>\n<{D}invoke name="rm_rf">\n<{D}parameter name="path" string="true">/'
    f'</{D}parameter>\n</{D}invoke>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
    f'string="true">Oslo</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>"
    '{"path": "/"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
}


@pytest.mark.parametrize("name", sorted(UNKNOWN))
def test_unknown_tools_are_dropped_like_sglang(name):
    text = UNKNOWN[name]
    content, calls = tool_parser(name).extract(text, TOOLS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    for chunk in (1, 3, 7):
        assert [(n, json.loads(a)) for _, n, a in stream(name, text, chunk)[1]] == [
            ("get_weather", {"city": "Oslo"})
        ]
    for kw in ({"forward_unknown": True}, {"tools": None}):  # SGLANG_FORWARD_UNKNOWN_TOOLS; or no tools given
        tools = kw.pop("tools", TOOLS)
        _, calls = tool_parser(name).extract(text, tools, **kw)
        assert [c.name for c in calls] == ["rm_rf", "get_weather"]
        assert [n for _, n, _ in stream(name, text, 3, tools, **kw)[1]] == ["rm_rf", "get_weather"]


def test_values_follow_the_schema():
    glm = (
        "<tool_call>search<arg_key>query</arg_key><arg_value>123</arg_value><arg_key>limit</arg_key>"
        "<arg_value>5</arg_value><arg_key>exact</arg_key><arg_value>true</arg_value><arg_key>filters</arg_key>"
        '<arg_value>{"lang": "en"}</arg_value><arg_key>tags</arg_key><arg_value>["a", "b"]</arg_value>'
        "<arg_key>extra</arg_key><arg_value>7</arg_value></tool_call>"
    )
    want = {
        "query": "123",
        "limit": 5,
        "exact": True,
        "filters": {"lang": "en"},
        "tags": ["a", "b"],
        "extra": 7,
    }
    _, calls = Glm45ToolParser.extract(glm, TOOLS)
    assert json.loads(calls[0].arguments) == want
    for chunk in (1, 3, 7):
        assert stream("glm45", glm, chunk)[1][0][2] == calls[0].arguments
    dsml = (
        f'<{D}function_calls>\n<{D}invoke name="search">\n'
        f'<{D}parameter name="query" string="false">123</{D}parameter>\n'  # schema: string stays string
        f'<{D}parameter name="limit" string="true">5</{D}parameter>\n'  # schema: integer
        f'<{D}parameter name="other" string="false">[1, 2]</{D}parameter>\n'  # no schema: string="false"
        f'<{D}parameter name="note" string="true">line "1"\nline 2</{D}parameter>\n'
        f"</{D}invoke>\n</{D}function_calls>"
    )
    _, calls = DeepSeekV32ToolParser.extract(dsml, TOOLS)
    assert json.loads(calls[0].arguments) == {
        "query": "123",
        "limit": 5,
        "other": [1, 2],
        "note": 'line "1"\nline 2',
    }
    for chunk in (1, 3, 7):
        assert stream("deepseekv32", dsml, chunk)[1][0][2] == calls[0].arguments


def test_openai_shapes_and_registry():
    assert ToolCall("call_1", "f", "{}").to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    assert ToolCallDelta(0, "call_1", "f").to_openai() == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(0, arguments="{").to_openai() == {"index": 0, "function": {"arguments": "{"}}
    for alias, canon in [
        ("deepseek_v3", "deepseekv3"),
        ("deepseek_v31", "deepseekv31"),
        ("deepseek_v32", "deepseekv32"),
        ("glm4_moe", "glm45"),
        ("glm47", "glm45"),
        ("glm5", "glm45"),
    ]:
        assert TOOL_PARSERS[alias] is TOOL_PARSERS[canon]
    assert set(REASONING_PARSERS) == {"deepseek-r1", "deepseek-v3", "glm45", "kimi_k2"}
    with pytest.raises(ValueError, match="deepseekv31"):
        tool_parser("hermes")
    with pytest.raises(ValueError, match="kimi_k2"):
        reasoning_parser("qwen3")


# -- reasoning ------------------------------------------------------------------------------------------


def rstream(name: str, thinking, text: str, chunk: int) -> tuple[str, str]:
    p = reasoning_parser(name)(thinking)
    r = c = ""
    for i in range(0, len(text), chunk):
        dr, dc = p.feed(text[i : i + chunk])
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    return r + dr, c + dc


R_CASES = [  # parser, thinking, text, reasoning, content
    ("deepseek-r1", None, "<think>\nLet me add.\n</think>\n\n2", "\nLet me add.\n", "\n\n2"),
    ("deepseek-r1", False, "Let me add.</think>2", "Let me add.", "2"),  # R1 always thinks; no start tag
    ("deepseek-r1", None, "still thinking when cut", "still thinking when cut", ""),  # no end tag
    ("deepseek-v3", True, "Let me add.</think>2", "Let me add.", "2"),
    ("deepseek-v3", None, "2", "", "2"),  # V3.1/V3.2 think only when asked
    ("deepseek-v3", False, "<think>x</think>2", "", "<think>x</think>2"),
    ("glm45", None, "<think>Let me add.</think>2", "Let me add.", "2"),
    ("glm45", True, "Let me add.</think>2", "Let me add.", "2"),  # the prompt opened the block
    ("glm45", False, "2", "", "2"),
    (
        "glm45",
        None,
        "Need a tool.<tool_call>get_weather</tool_call>",
        "Need a tool.",
        "<tool_call>get_weather</tool_call>",
    ),
    ("kimi_k2", None, "<think>Let me add.</think>2", "Let me add.", "2"),
    (
        "kimi_k2",
        None,
        "Need a tool.<|tool_calls_section_begin|>",
        "Need a tool.",
        "<|tool_calls_section_begin|>",
    ),
    ("kimi_k2", False, "2", "", "2"),
]


@pytest.mark.parametrize("case", R_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(R_CASES)])
def test_reasoning_split_and_stream(case):
    name, thinking, text, reasoning, content = case
    p = reasoning_parser(name)(thinking)
    assert p.split(text) == (reasoning, content)
    for chunk in (1, 3, 7):
        assert rstream(name, thinking, text, chunk) == (reasoning, content)


@pytest.mark.parametrize(
    "name, on",
    [
        ("deepseek-r1", (True, True, True)),
        ("deepseek-v3", (False, True, False)),
        ("glm45", (True, True, False)),
        ("kimi_k2", (True, True, False)),
    ],
)
def test_thinking_defaults(name, on):
    """thinking None/True/False: R1 always thinks, V3.1/V3.2 when asked, GLM and Kimi unless told not."""
    assert tuple(reasoning_parser(name)(t).starts_in_reasoning for t in (None, True, False)) == on


def test_reasoning_holds_back_partial_tags_and_reads_kwargs():
    p = reasoning_parser("deepseek-r1")()
    assert p.feed("<th") == ("", "")  # maybe the start tag
    assert p.feed("ink>abc</th") == ("abc", "")  # maybe the end tag
    assert p.feed("ink>done") == ("", "done")
    assert thinking_from_kwargs({"enable_thinking": False}) is False
    assert thinking_from_kwargs({"thinking": True}) is True and thinking_from_kwargs(None) is None
    assert reasoning_parser("deepseek-v3").from_kwargs({"thinking": True}).starts_in_reasoning
    assert not reasoning_parser("glm45").from_kwargs({"enable_thinking": False}).starts_in_reasoning


# -- DeepSeek-V3.2 encoding -----------------------------------------------------------------------------

BOS, U, A = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS_BLOCK = "\n".join(  # the official TOOLS_SYSTEM_TEMPLATE, line by line
    [
        "## Tools",
        "",
        "You have access to a set of tools you can use to answer the user's question.",
        f'You can invoke functions by writing a "<{D}function_calls>" block like the following as part of '
        "your reply to the user:",
        f"<{D}function_calls>",
        f'<{D}invoke name="$FUNCTION_NAME">',
        f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>',
        "...",
        f"</{D}invoke>",
        f'<{D}invoke name="$FUNCTION_NAME2">',
        "...",
        f"</{D}invoke>",
        f"</{D}function_calls>",
        "",
        "String and scalar parameters should be specified as is without any escaping or quotes, while lists "
        'and objects should use JSON format. The "string" attribute should be set to "true" for string type '
        'parameters and "false" for other types (numbers, booleans, arrays, objects).',
        "",
        "If the thinking_mode is enabled, then after function results you should strongly consider "
        "outputting a thinking block. Here is an example:",
        "",
        f"<{D}function_calls>",
        "...",
        f"</{D}function_calls>",
        "",
        "<function_results>",
        "...",
        "</function_results>",
        "",
        "<think>...thinking about results</think>",
        "",
        "Here are the functions available in JSONSchema format:",
        "<functions>",
        '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}}}',
        "</functions>",
        "",
    ]
)
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}
INVOKE = (
    f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>'
)


def dsml_calls(n: int) -> str:
    return f"\n\n<{D}function_calls>\n" + "\n".join([INVOKE] * n) + f"\n</{D}function_calls>{EOS}"


TOOL_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "reasoning_content": "Got it.", "content": "Sunny."},
]
README = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
]


def test_dsv32_chat_and_thinking_turns():
    assert dsv32.render(README, thinking=True) == (  # the README's example: old reasoning is dropped
        f"{BOS}{U}hello{A}</think>Hello! I am DeepSeek.{EOS}{U}1+1=?{A}<think>"
    )
    assert dsv32.render(README) == f"{BOS}{U}hello{A}</think>Hello! I am DeepSeek.{EOS}{U}1+1=?{A}</think>"
    assert dsv32.render(README, add_generation_prompt=False).endswith(f"{EOS}{U}1+1=?")
    dev = [{"role": "developer", "content": "hi"}]
    assert dsv32.render(dev, thinking=True) == f"{BOS}{U}\n\n# The user's message is: hi{A}<think>"


def test_dsv32_tools_calls_and_results():
    assert dsv32.render(TOOL_TURN, tools=[WEATHER], thinking=True) == (
        f"{BOS}Be brief.\n\n{TOOLS_BLOCK}{U}Weather in Paris?{A}<think>Need the tool.</think>{dsml_calls(1)}"
        "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>"
        f"Got it.</think>Sunny.{EOS}"
    )
    # chat mode, no system message (an empty one carries the tools), two results, prompt ends after them
    msgs = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    results = "\n\n<function_results>\n<result>sunny</result>\n<result>rainy</result>\n</function_results>"
    assert dsv32.render(msgs, tools=[WEATHER]) == (
        f"{BOS}\n\n{TOOLS_BLOCK}{U}Weather in Paris and Rome?{A}</think>Checking."
        f"{dsml_calls(2)}{results}\n\n</think>"
    )
    assert dsv32.render(msgs, tools=[WEATHER], add_generation_prompt=False).endswith(results)


def test_dsv32_rejects_what_the_encoder_rejects():
    with pytest.raises(ValueError):  # a thinking turn after the last user message needs reasoning or calls
        dsv32.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], thinking=True)
    with pytest.raises(ValueError):  # a tool result needs the assistant's call
        dsv32.render([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}])


def test_number_past_float_range_stays_valid_json():
    """`1e999` fits JSON (numbers have no range) but not a float: the arguments keep its text rather
    than writing Infinity, which strict JSON clients refuse; NaN is no JSON number and stays text."""
    from splash.chat.base import convert_value, dumps

    v = convert_value(" 99e29999", {"number"}, None)
    assert dumps({"a": v, "b": [1.5, v]}) == '{"a": 99e29999, "b": [1.5, 99e29999]}'
    json.loads(dumps({"a": v}), parse_constant=lambda c: pytest.fail(f"{c} in the arguments"))
    assert convert_value("NaN", {"number"}, None) == "NaN"
