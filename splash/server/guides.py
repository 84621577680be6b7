"""A request's structured-output and sampling-control fields, read the way each peer spells them, into the
engine's `StructuredOutputs` and `SamplingParams` fields; the grammar compiled up front (a bad schema,
regex or grammar is a 400 naming it, before anything is queued).

Accepted spellings of a constraint (one per request): OpenAI's `response_format` (`json_object`,
`json_schema` with its `schema`; `text` is none; SGLang's `structural_tag`), vLLM's `structured_outputs`
({json | json_object | regex | choice | grammar | structural_tag}) and its older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`, SGLang's `json_schema` / `regex` / `ebnf`.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool

from splash.engine.sampling import StructuredOutputs
from splash.server.errors import APIError

_VLLM_KEYS = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
              "grammar": "grammar", "structural_tag": "structural_tag"}
_VLLM_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern", "backend")


def structured_from(req: Any, prefix: str = "") -> tuple[StructuredOutputs | None, str | None]:
    """(the constraint a request asks for or None, the parameter that asked); 400 when it asks twice
    or in a shape no peer accepts. `prefix`: where the fields sit (`sampling_params.` on /generate)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = getattr(req, "response_format", None)
    if rf:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema") or {}
            schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                               "\"schema\": {...}}}", param=f"{prefix}response_format", code="invalid_value")
            found.append(("response_format", {"json": schema}))
        elif kind == "structural_tag":
            found.append(("response_format", {"structural_tag": json.dumps(rf)}))
        elif kind not in (None, "text"):
            raise APIError(f"response_format type {kind!r} is unknown; use text, json_object or json_schema",
                           param=f"{prefix}response_format", code="invalid_value")
    so = getattr(req, "structured_outputs", None)
    if so:
        kw = {}
        for k, v in so.items():
            if k in _VLLM_KEYS and v not in (None, False):
                kw[_VLLM_KEYS[k]] = v
            elif k not in _VLLM_KEYS and k not in _VLLM_IGNORED:
                raise APIError(f"structured_outputs.{k} is unknown; use one of json, json_object, regex, "
                               f"choice, grammar, structural_tag", param=f"{prefix}structured_outputs",
                               code="invalid_value")
        if kw:
            found.append(("structured_outputs", kw))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar"), ("json_schema", "json"), ("regex", "regex"),
                        ("ebnf", "grammar")):
        v = getattr(req, field, None)
        if v not in (None, "", []):
            found.append((field, {kind: v}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(f"give one structured-output constraint; got {found[0][0]} and {found[1][0]}",
                       param=f"{prefix}{found[1][0]}", code="invalid_value")
    param, kw = found[0]
    if "json" in kw and isinstance(kw["json"], str):
        try:
            kw["json"] = json.loads(kw["json"])
        except json.JSONDecodeError as e:
            raise APIError(f"the JSON schema is not JSON: {e.msg} at {e.pos}", param=f"{prefix}{param}",
                           code="invalid_value") from None
    if "structural_tag" in kw and not isinstance(kw["structural_tag"], str):
        kw["structural_tag"] = json.dumps(kw["structural_tag"])
    try:
        return StructuredOutputs(**kw), f"{prefix}{param}"
    except (TypeError, ValueError) as e:
        raise APIError(str(e), param=f"{prefix}{param}", code="invalid_value") from None


async def compile_guide(engine: Any, spec: StructuredOutputs, param: str) -> None:
    """Compile `spec` now, in a worker thread, into the engine's cache: a bad one is a 400 naming it."""
    from splash.engine.grammar import GrammarError

    llm = getattr(engine, "engine", engine)
    try:
        backend = await run_in_threadpool(llm.grammar_backend)
        await run_in_threadpool(backend.compile, spec)
    except GrammarError as e:
        raise APIError(str(e), param=param, code="invalid_grammar") from None


def control_fields(req: Any, vocab_size: int | None, defaults: dict[str, Any], prefix: str = ""
                   ) -> dict[str, Any]:
    """SamplingParams keywords of the sampling controls both peers take: penalties, min_p, logit_bias
    (OpenAI's string keys -> token ids, checked against the vocabulary), include_stop_str_in_output; a
    field the request leaves unset takes the model's generation_config default (vLLM's `auto`)."""
    out: dict[str, Any] = {}
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("min_p", 0.0)):
        v = getattr(req, name, None)
        if v is None:
            v = defaults.get(name, neutral)
        out[name] = float(v)
    bias = getattr(req, "logit_bias", None)
    if bias:
        ids: dict[int, float] = {}
        for k, v in bias.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                raise APIError(f"logit_bias keys are token ids; got {k!r}", param=f"{prefix}logit_bias",
                               code="invalid_value") from None
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise APIError(f"logit_bias holds token {t}, outside the vocabulary [0, {vocab_size})",
                               param=f"{prefix}logit_bias", code="invalid_value")
            ids[t] = float(v)
        out["logit_bias"] = ids
    out["include_stop_str_in_output"] = bool(getattr(req, "include_stop_str_in_output", False)
                                             or getattr(req, "no_stop_trim", False))
    return out
