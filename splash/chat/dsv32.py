"""DeepSeek-V3.2's chat encoding. Its checkpoints ship no Jinja chat template; the format is defined by
the Python encoder in the model repository (encoding/encoding_dsv32.py, `encode_messages`), which this
module renders the same way, byte for byte, written from reading it:

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ... </functions>\\n]
    <｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{answer}\\n\\n<｜DSML｜function_calls>...
        </｜DSML｜function_calls><｜end▁of▁sentence｜>\\n\\n<function_results>\\n<result>...</result>
        \\n</function_results>\\n\\n<think>...

(lines wrapped here). In thinking mode only the turns after the last user message are thinking: the
last user message (and the tool results that follow it) end with `<think>`, earlier ones with
`</think>`, and an assistant turn shows its reasoning_content only after the last user message (older
reasoning is dropped, the official drop_thinking). Tools are given to the system message, one is
inserted empty when the conversation has none (as SGLang's server does).
"""

from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your \
reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and \
objects should use JSON format. The "string" attribute should be set to "true" for string type parameters \
and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a \
thinking block. Here is an example:

<{dsml}function_calls>
...
</{dsml}function_calls>

<function_results>
...
</function_results>

{think}...thinking about results{end_think}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

RESPONSE_FORMAT_TEMPLATE = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    """Message content as text: None is empty, a list of OpenAI content parts is its text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The tools block of the system prompt: the DSML instructions and one JSON schema a line."""
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls in DSML: strings as is (string="true"), other values as JSON."""
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments") or {}
        args = json.loads(args) if isinstance(args, str) else args
        if not isinstance(args, dict):
            raise ValueError(f"tool call arguments must be a JSON object: {fn.get('arguments')!r}")
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{DSML}invoke name="{fn.get("name")}">\n{params}\n</{DSML}invoke>')
    return f"<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


def _extras(msg: dict[str, Any]) -> str:
    out = ""
    if msg.get("tools"):
        out += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT_TEMPLATE + _json(msg["response_format"])
    return out


def _render_message(i: int, msgs: list[dict[str, Any]], thinking: bool, last_user: int) -> str:
    msg = msgs[i]
    role = msg.get("role")
    content = _text(msg.get("content"))
    if role == "system":
        return content + _extras(msg)
    if role in ("user", "developer"):
        if role == "developer":
            if not content:
                raise ValueError("a developer message needs content")
            content = _extras(msg) + "\n\n# The user's message is: " + content
        return USER + content + ASSISTANT + (THINK if thinking and i == last_user else END_THINK)
    if role == "tool":
        j = i - 1
        while j >= 0 and msgs[j].get("role") == "tool":
            j -= 1
        calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j].get("role") == "assistant" else None
        order = i - j
        if not calls or len(calls) < order:
            raise ValueError(f"message {i}: a tool result without a matching assistant tool call")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{content}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + (THINK if thinking and i >= last_user else END_THINK)
        return out
    if role == "assistant":
        calls = msg.get("tool_calls")
        reasoning = ""
        if thinking and i > last_user:
            if not (msg.get("reasoning_content") or calls):
                raise ValueError(
                    f"message {i}: a thinking-mode assistant turn needs reasoning_content or tool_calls"
                )
            reasoning = (msg.get("reasoning_content") or "") + END_THINK
        return reasoning + content + ("\n\n" + render_tool_calls(calls) if calls else "") + EOS
    raise ValueError(f"message {i}: unknown role {role!r}")


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of `messages` (OpenAI chat format) for DeepSeek-V3.2, as encode_messages gives it
    (thinking_mode "thinking" or "chat"). The official encoder always ends a user or tool turn with the
    assistant's opening (`<｜Assistant｜><think>` or `</think>`); `add_generation_prompt=False` leaves that
    opening off the final turn, which is all it changes."""
    msgs = [dict(m) for m in messages]
    if tools:
        if not msgs or msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = tools
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1)
    prompt = BOS + "".join(_render_message(i, msgs, thinking, last_user) for i in range(len(msgs)))
    if not add_generation_prompt and msgs:
        opening = THINK if thinking else END_THINK
        role = msgs[-1].get("role")
        if role in ("user", "developer"):
            prompt = prompt.removesuffix(ASSISTANT + (opening if len(msgs) - 1 == last_user else END_THINK))
        elif role == "tool" and prompt.endswith("</function_results>\n\n" + opening):
            prompt = prompt[: -len("\n\n" + opening)]
    return prompt
