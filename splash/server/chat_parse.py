"""What a chat request asks of its output beyond tokens: reasoning apart from content, tool calls in the
model's own format, and the constraint that enforces a required or named tool call (or a response
format) by grammar. `ChatPlan` is worked out once per request; `ChoiceParser` splits one choice's text,
whole or streamed, in that order: reasoning first (its end tag, or a tool section, closes it), then the
content's tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splash.chat import reasoning_parser as reasoning_class
from splash.chat import tool_parser as tool_class
from splash.chat.base import ToolCall, ToolCallDelta
from splash.chat.reasoning import thinking_from_kwargs
from splash.engine.sampling import StructuredOutputs
from splash.server.errors import APIError
from splash.server.guides import structured_from


@dataclass
class ChatPlan:
    """One chat request's output handling: which parsers run, the tools, the constraint (if any)."""

    tools: list[dict[str, Any]] | None = None  # what the template renders and the parser checks names on
    tool_parser: Any = None  # the parser class, when tool calls are parsed
    reasoning_parser: Any = None  # the parser class, when reasoning is separated
    thinking: bool | None = None
    structured: StructuredOutputs | None = None
    structured_param: str | None = None
    forced: bool = False  # tool_choice required or named: the answer is tool calls only
    names: list[str] = field(default_factory=list)

    @property
    def parses(self) -> bool:
        """Whether the text is post-processed (then special tokens stay in it: the formats use them)."""
        return self.tool_parser is not None or self.reasoning_parser is not None


def plan_chat(req: Any, tool_parser: str | None, reasoning_parser: str | None, end_ids: Any) -> ChatPlan:
    """The request's ChatPlan; 400 for a tool_choice no format can honour. `end_ids(text) -> ids`: the
    token ids of a reasoning end tag (a constraint starts after it)."""
    plan = ChatPlan(thinking=thinking_from_kwargs(req.chat_template_kwargs))
    if reasoning_parser and req.separate_reasoning:
        plan.reasoning_parser = reasoning_class(reasoning_parser)
    plan.structured, plan.structured_param = structured_from(req)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    tools = req.tools or []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise APIError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                           "\"parameters\": {...}}}", param=f"tools[{i}]", code="invalid_value")
        plan.names.append(fn["name"])
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not name:
            raise APIError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
        if name not in plan.names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools "
                           f"({', '.join(plan.names) or 'none given'})", param="tool_choice",
                           code="invalid_value")
    elif choice not in ("none", "auto", "required"):
        raise APIError(f"tool_choice {choice!r} is unknown; use none, auto, required or a named function",
                       param="tool_choice", code="invalid_value")
    if choice != "none" and not tools:
        raise APIError(f"tool_choice {choice if isinstance(choice, str) else 'named'} needs tools",
                       param="tool_choice", code="invalid_value")
    plan.tools = tools or None
    if tools and choice != "none":
        if tool_parser:
            plan.tool_parser = tool_class(tool_parser)
        elif choice != "auto":
            raise APIError("tool_choice required or named needs the model's tool-call format: start the "
                           "server with --tool-call-parser (deepseekv3, deepseekv31, deepseekv32, glm45, "
                           "kimi_k2)",
                           param="tool_choice", code="unsupported_parameter")
    if tools and choice not in ("none", "auto"):
        if plan.structured is not None:
            raise APIError("tool_choice required or named and a response format cannot both constrain the "
                           "answer; drop one", param="tool_choice", code="invalid_value")
        from splash.chat.tool_grammar import tool_call_structural_tag

        parallel = req.parallel_tool_calls is not False
        try:
            tag = tool_call_structural_tag(tool_parser, tools, choice, parallel)
        except ValueError as e:
            raise APIError(str(e), param="tools", code="invalid_value") from None
        plan.structured = StructuredOutputs(structural_tag=tag)
        plan.structured_param, plan.forced = "tools", True
    if plan.structured is not None and plan.reasoning_parser is not None:
        r = plan.reasoning_parser(plan.thinking)
        if r.thinking_enabled:  # the constraint holds for the answer, after the reasoning
            ids = tuple(end_ids(plan.reasoning_parser.end_tag))
            plan.structured = StructuredOutputs(**{plan.structured.kind: getattr(plan.structured,
                                                                                plan.structured.kind)},
                                                start_after=ids)
    return plan


class ChoiceParser:
    """One choice's text split into reasoning, content and tool calls (whole or streamed)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.reasoning = plan.reasoning_parser(plan.thinking) if plan.reasoning_parser else None
        self.tools = plan.tool_parser(plan.tools) if plan.tool_parser else None
        self.called = False

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning or None, content or None, calls) of a finished choice."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = type(self.tools).extract(text, self.plan.tools)
        self.called = bool(calls)
        content = text if text.strip() or not calls else None
        return (reasoning or None), content, calls

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning delta, content delta, tool-call deltas in OpenAI's shape) of the next text."""
        r, c = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if final and self.reasoning is not None:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        if self.tools is None:
            return r, c, []
        items = self.tools.feed(c) + (self.tools.finish() if final else [])
        content = "".join(x for x in items if isinstance(x, str))
        calls = [x.to_openai() for x in items if isinstance(x, ToolCallDelta)]
        self.called = self.called or bool(calls)
        return r, content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the choice called tools and ended by itself."""
        return "tool_calls" if self.called and reason == "stop" else reason
