"""Which tool-call and reasoning formats a checkpoint speaks, read off its chat template (what it renders
is what the model was trained to emit) and its `model_type`, for a server started without
`--tool-call-parser` / `--reasoning-parser`. A flag given always wins; a format that cannot be told
stays None (tool calls then come back as content, as the peers do without a parser)."""

from __future__ import annotations

# (marker in the template, tool parser); the first that matches wins (DSML before DeepSeek's own tokens)
_TOOL_MARKERS = (
    ("｜DSML｜", "deepseekv32"),
    ("function<｜tool▁sep｜>", "deepseekv3"),
    ("<｜tool▁call▁begin｜>", "deepseekv31"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<arg_key>", "glm45"),
)


def detect_tool_parser(template: str | None, model_type: str | None) -> str | None:
    """The tool-call parser name for a chat template (and model type), or None."""
    if model_type == "deepseek_v32" and not template:
        return "deepseekv32"  # (its format lives in the Python encoder, splash/chat/dsv32.py)
    for marker, name in _TOOL_MARKERS:
        if template and marker in template:
            return name
    return None


def detect_reasoning_parser(template: str | None, model_type: str | None) -> str | None:
    """The reasoning parser name for a chat template (and model type), or None."""
    if model_type == "deepseek_v32" and not template:
        return "deepseek-v3"  # thinking switched by chat_template_kwargs, as V3.1's
    if not template or "<think>" not in template and "</think>" not in template:
        return None
    if "<|tool_calls_section_begin|>" in template or "kimi" in (model_type or ""):
        return "kimi_k2"
    if "<arg_key>" in template or (model_type or "").startswith("glm"):
        return "glm45"
    if "thinking" in template:  # a template that switches thinking on a variable (V3.1 / V3.2 style)
        return "deepseek-v3"
    return "deepseek-r1"
