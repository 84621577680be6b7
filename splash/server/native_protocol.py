"""Pydantic shapes of SGLang's native API (`/generate`, weight updates, memory release).

Field names and defaults follow SGLang (`GenerateReqInput`, its `sampling_params`, the update and
memory requests), so RL clients written for SGLang (slime, verl's HTTP rollout) work unchanged.
Unknown fields are refused (a typo is a 400 naming it); fields SGLang has but splash does not
implement are accepted only at their neutral value (`unsupported()`); `custom_params` is a free-form
dict in SGLang too, so its unknown keys are ignored rather than refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from splash.server.protocol import INT64_MAX, MAX_N

TokenIds = list[StrictInt]


class _Native(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class NativeSamplingParams(_Native):
    """SGLang's `sampling_params` of /generate."""

    max_new_tokens: int | None = Field(None, ge=1)  # None: SGLang's 128, capped by the context
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted; the byte-level decoders have no such choice
    no_stop_trim: bool = False
    sampling_seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang hands these to a custom logit processor and otherwise ignores them; splash has none, so only
    # return_top_p_token_ids (slime's top-p replay) means something, every other key is ignored.
    custom_params: dict[str, Any] | None = None

    @property
    def return_top_p_token_ids(self) -> bool:
        return (self.custom_params or {}).get("return_top_p_token_ids", False) is True

    def unsupported(self) -> list[tuple[str, str]]:
        out = []
        flag = (self.custom_params or {}).get("return_top_p_token_ids", False)
        if not isinstance(flag, bool):
            out.append(("custom_params", f"custom_params.return_top_p_token_ids must be true or false, got "
                                         f"{flag!r}"))
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            out.append(("sampling_seed", "seed and sampling_seed disagree; send one"))
        return out


class GenerateRequest(_Native):
    """POST /generate: `text` or `input_ids` (one prompt, or a batch of them)."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1  # >= 0: input_token_logprobs from that prompt position on
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)  # routed experts of positions [start, seqlen - 1)
    # prefill/decode disaggregation (sglang-router's PD mode adds them; one per prompt for a batch):
    # where the prefill's bootstrap server is and the room that pairs the two halves of a request
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | None | list[int | None] = None
    bootstrap_room: int | list[int] | None = None
    model: str | None = None  # sglang-router forwards it (null unless the client set it): this server's name
    # SGLang's logging switches (sglang-router sends both on every request); splash logs no single request
    log_metrics: bool = True
    no_logs: bool = False
    # SGLang fields accepted at their neutral value only (sglang-router sends return_hidden_states and the
    # last three, neutral)
    return_hidden_states: bool = False
    lora_path: str | None = None
    image_data: Any = None
    session_params: Any = None
    custom_logit_processor: str | None = None
    data_parallel_rank: int | None = None
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


class AbortRequest(_Native):
    rid: str | list[str] = ""
    abort_all: bool = False


class PauseRequest(_Native):
    mode: str = "abort"


class UpdateFromDiskRequest(_Native):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateFromTensorRequest(_Native):
    """SGLang's body: one serialized payload per engine rank (splash/server/tensor_ipc.py)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitGroupRequest(_Native):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str | None = None


class UpdateFromDistributedRequest(_Native):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class DestroyGroupRequest(_Native):
    group_name: str = "weight_update_group"


class MemoryRequest(_Native):
    tags: list[str] | None = None
