"""Pydantic shapes of the OpenAI API subset splash serves (requests validated, responses built).

Requests forbid unknown fields (as OpenAI does) so a typo such as `max_token` is a clear 400 instead
of a silently ignored setting; floats refuse NaN/Infinity, which JSON parsers otherwise let through.
Fields that OpenAI defines but splash does not implement are accepted only at their neutral value
(see `unsupported()`), so a client that sends the default still works.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

MAX_N = 128
INT64_MAX = 2**63 - 1

TokenIds = list[StrictInt]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, vLLM and SGLang extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions (`vllm bench serve`-style clients, agent frameworks, RL loops)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for the same (sglang-router sends it on every request)
    return_hidden_states: bool = False  # SGLang's; only false (sglang-router sends it)
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids (streamed too)
    # prefill/decode disaggregation (sglang-router's PD mode; lists for a batch of prompts): SGLang's fields
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | None | list[int | None] = None
    bootstrap_room: int | list[int] | None = None
    # Structured outputs: OpenAI's response_format; vLLM's structured_outputs (json, regex, choice, grammar,
    # json_object, structural_tag) and its older guided_* names; SGLang's regex / ebnf / json_schema.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, reason) for settings splash would otherwise silently ignore."""
        if self.return_hidden_states:
            return [("return_hidden_states", "hidden states are not returned; send return_hidden_states "
                                             "false")]
        return []


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One message for every wrong shape instead of pydantic's per-union-member errors.
        ok = isinstance(v, str) or _is_ids(v) or (
            isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(_is_ids(p) for p in v)))
        if not ok:
            raise ValueError(f"prompt must be {PROMPT_SHAPES}")
        return v

    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion, with its logprobs when logprobs is set
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens 0 returns nothing without echo: send echo true to score "
                                      "the prompt, or max_tokens >= 1"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", "best_of must equal n (no server-side ranking)"))
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Clients echo assistant turns back with extra keys (refusal, audio, ...): kept, and the template sees
    # the message whole (tool_calls, tool_call_id, reasoning_content, name included).
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    chat_template: str | None = None  # this request's template (Jinja text) instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables: thinking, ...
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    separate_reasoning: bool = True  # SGLang's: reasoning_content apart from content
    stream_reasoning: bool = True  # SGLang's: false sends the reasoning in one delta once it is complete
    reasoning_effort: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


# ---- responses ------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        """OpenAI's usage, the prefix cache's hits in `prompt_tokens_details.cached_tokens`."""
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "splash"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None  # splash extension: lets `splash bench serve` draw random token ids


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids
    prompt_token_ids: list[int] | None = None  # return_token_ids (this choice's prompt)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class TopLogProb(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProb(TopLogProb):
    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(_Response):
    content: list[ChatLogProb] | None = None
    refusal: list[ChatLogProb] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    refusal: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {index, id, type, function: {name, arguments}}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


def stream_chunk(obj: str, rid: str, created: int, model: str, choices: list[BaseModel],
                 usage: UsageInfo | None, include_usage: bool) -> dict[str, Any]:
    """One SSE chunk as OpenAI sends it: `usage` present (null until the last) only when asked for."""
    chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                             "system_fingerprint": None,
                             "choices": [_dump_choice(c) for c in choices]}
    if include_usage:
        chunk["usage"] = usage.model_dump() if usage is not None else None
    return chunk


def _dump_choice(c: BaseModel) -> dict[str, Any]:
    d = c.model_dump()
    if isinstance(c, ChatStreamChoice):
        # A delta carries only what changed: {"role": ..., "content": ""} first, then {"content": ...}.
        d["delta"] = c.delta.model_dump(exclude_none=True)
    return d
