"""Reasoning parsers: split a response into its thinking part and its answer, whole or streamed, with
SGLang's `--reasoning-parser` names (`deepseek-r1`, `deepseek-v3`, `glm45`, `kimi_k2`).

Whether a request thinks comes from its chat_template_kwargs (`thinking` or `enable_thinking`); each
family has its own default. A thinking response starts inside the reasoning block, since chat
templates open it in the prompt (DeepSeek-R1, DeepSeek-V3.1/V3.2 in thinking mode, newer GLM templates);
a start tag the model writes itself (R1-0528, GLM-4.5, Kimi-K2-Thinking) is dropped. The block
ends at the end tag; with no end tag the whole response is reasoning (it was cut off while thinking).
This is SGLang's force_reasoning behaviour, which SGLang turns on exactly when thinking is enabled.
A response that does not think is all content.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .base import find_first, partial_suffix


def thinking_from_kwargs(chat_template_kwargs: dict[str, Any] | None) -> bool | None:
    """The request's thinking switch: `thinking` (DeepSeek, Kimi) or `enable_thinking` (GLM, Qwen)."""
    kw = chat_template_kwargs or {}
    value = kw.get("thinking", kw.get("enable_thinking"))
    return None if value is None else bool(value)


class ReasoningParser:
    """One response's reasoning/content splitter; `feed` deltas then `finish`, or `split` a whole text.

    `default` is the family's policy when the request says nothing: "always" (cannot be turned off),
    "on" (thinks unless told `false`), or "off" (thinks only when told `true`).
    """

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    tool_start: ClassVar[str | None] = None  # a tool section that ends reasoning without the end tag
    default: ClassVar[str] = "on"

    def __init__(self, thinking: bool | None = None) -> None:
        if self.default == "always":
            self.thinking_enabled = True
        elif self.default == "off":
            self.thinking_enabled = thinking is True
        else:
            self.thinking_enabled = thinking is not False
        self._state = "start" if self.thinking_enabled else "content"
        self._buf = ""
        self._final = False

    @classmethod
    def from_kwargs(cls, chat_template_kwargs: dict[str, Any] | None) -> ReasoningParser:
        return cls(thinking_from_kwargs(chat_template_kwargs))

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether the response's first text is reasoning (the prompt opened the thinking block)."""
        return self.thinking_enabled

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole response."""
        p = type(self)(self.thinking_enabled)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return r1 + r2, c1 + c2

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of text; partial tags are held back."""
        self._buf += text
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Release what was held back at the end of the response."""
        self._final = True
        return self.feed("")

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.start_tag):
                self._buf = head[len(self.start_tag) :]
            elif not self._final and self.start_tag.startswith(head):
                return False  # could still be the start tag (or only whitespace so far)
            self._state = "reasoning"
            return True
        if self._state == "reasoning":
            stops = (self.end_tag,) + ((self.tool_start,) if self.tool_start else ())
            pos, tok = find_first(self._buf, stops)
            if pos == -1:
                n = len(self._buf) if self._final else len(self._buf) - partial_suffix(self._buf, stops)
                reasoning.append(self._buf[:n])
                self._buf = self._buf[n:]
                return False
            reasoning.append(self._buf[:pos])
            self._buf = self._buf[pos + (len(tok) if tok == self.end_tag else 0) :]
            self._state = "content"
            return True
        content.append(self._buf)
        self._buf = ""
        return False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: always thinks; R1's template opens `<think>` in the prompt, R1-0528 writes it."""

    name = "deepseek-r1"
    default = "always"


class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1/V3.2: thinks only with `thinking: true` (the template then ends the prompt with
    `<think>`; without it the prompt ends with `</think>` and the response is all content)."""

    name = "deepseek-v3"
    default = "off"


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5 to GLM-5: thinks unless `enable_thinking: false`; a `<tool_call>` inside the reasoning
    ends it (the tool call and what follows are content), as in SGLang's glm45 parser."""

    name = "glm45"
    tool_start = "<tool_call>"


class KimiK2ReasoningParser(ReasoningParser):
    """Kimi-K2 thinking models: `<think>...</think>` (SGLang's kimi_k2; the older Kimi's `◁think▷` tags are
    SGLang's separate `kimi` parser), on unless `thinking: false`; the tool section may open before
    `</think>` and then ends the reasoning."""

    name = "kimi_k2"
    tool_start = "<|tool_calls_section_begin|>"
