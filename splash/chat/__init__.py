"""What agent frameworks need on top of a model's raw generated text, under the names SGLang and vLLM
use: tool-call parsers that turn DeepSeek-V3/V3.1/V3.2, GLM-4.5..GLM-5 and Kimi-K2 output into OpenAI
`tool_calls` (whole or streamed), reasoning parsers that split the thinking from the answer, and
DeepSeek-V3.2's chat encoding (`dsv32.render`), whose checkpoints ship no Jinja template. Pure Python
and standard library only; this package imports nothing else from splash, so the server (or anything
else) can use it without pulling in the engine.
"""

from __future__ import annotations

from . import dsv32
from .base import Delta, ToolCall, ToolCallDelta, ToolParser
from .json_tools import DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser
from .reasoning import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    KimiK2ReasoningParser,
    ReasoningParser,
    thinking_from_kwargs,
)
from .xml_tools import DeepSeekV32ToolParser, Glm45ToolParser

# SGLang's --tool-call-parser names, then vLLM's spellings and the GLM generations as aliases.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseekv3": DeepSeekV3ToolParser,
    "deepseekv31": DeepSeekV31ToolParser,
    "deepseekv32": DeepSeekV32ToolParser,
    "glm45": Glm45ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "deepseek_v32": DeepSeekV32ToolParser,
    "glm": Glm45ToolParser,
    "glm4_moe": Glm45ToolParser,
    "glm47": Glm45ToolParser,
    "glm5": Glm45ToolParser,
}

# SGLang's --reasoning-parser names.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1ReasoningParser,
    "deepseek-v3": DeepSeekV3ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "kimi_k2": KimiK2ReasoningParser,
}


def tool_parser(name: str) -> type[ToolParser]:
    """The tool-call parser class registered as `name`."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered as `name`."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "DeepSeekV32ToolParser",
    "Delta",
    "Glm45ReasoningParser",
    "Glm45ToolParser",
    "KimiK2ReasoningParser",
    "KimiK2ToolParser",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "dsv32",
    "reasoning_parser",
    "thinking_from_kwargs",
    "tool_parser",
]
