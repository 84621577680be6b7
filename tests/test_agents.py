"""Agents on the OpenAI API: a live `splash serve` of a DeepSeek-V3.1-format checkpoint
(tests/helpers_agent.py, random weights) driven by the official `openai` client as an agent framework
drives it.

Checked: the tool-call and reasoning formats are read off the checkpoint; `tool_choice` required and
named give calls whose arguments validate against the tool's schema (jsonschema), whole and streamed
(the streamed deltas reassemble to the same calls as the same seed unstreamed); a multi-turn loop sends
the calls and their results back and the prompt carries them (nothing dropped); `response_format`
json_schema / json_object, vLLM's `structured_outputs` (regex, choice) and SGLang's `ebnf` hold on
noise; a constraint after the reasoning leaves the reasoning free and holds the answer; bad tools, tool
choices and grammars are 400s naming the field and leave no KV page taken; `/tokenize`, `/detokenize`,
`/version`, `return_token_ids`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers_agent import TOOLS, WEATHER, write_agent_checkpoint
from serve_utils import ServeProcess

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "system", "content": "You are a helpful agent."},
       {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_agent_checkpoint(tmp_path_factory.mktemp("agent") / "v31")
    gen = json.loads((Path(ckpt) / "generation_config.json").read_text())
    gen.update(temperature=0.0, repetition_penalty=1.5)  # defaults a request that says nothing gets
    (Path(ckpt) / "generation_config.json").write_text(json.dumps(gen))
    srv = ServeProcess(["--model", ckpt, "--dtype", "float32", "--max-model-len", "2048", "--num-kv-pages",
                        "96", "--max-num-seqs", "8", "--served-model-name", "agent"])
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=240)


def validate_calls(calls, names=None) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking it against its tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in (names or schemas), c.function.name
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append((c.function.name, args))
    return out


def kv_pages_used(server) -> float:
    r = httpx.get(server.url + "/get_server_info", timeout=30)
    assert r.status_code == 200
    return r.json()["internal_states"][0]["kv_pages_used"]


def test_formats_are_read_off_the_checkpoint(server):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["tool_call_parser"] == "deepseekv31" and info["reasoning_parser"] == "deepseek-v3"
    assert info["chat_format"] == "jinja" and info["grammar_backend"] == "xgrammar"


def test_required_tool_call_validates_and_streams_the_same(client):
    kw = dict(model="agent", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
              max_tokens=400)
    whole = client.chat.completions.create(n=3, seed=11, **kw)
    for ch in whole.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert not (ch.message.content or "").strip()
        validate_calls(ch.message.tool_calls)
    # streamed, one choice: name first, then argument pieces that join to the unstreamed call
    one = client.chat.completions.create(seed=5, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(seed=5, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert c["id"] is None, "a call announced twice"
                    c["id"], c["name"] = d.id, d.function.name
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert got == validate_calls(one.message.tool_calls)


def test_named_tool_choice_calls_that_tool_once(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="agent", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=400,
            tool_choice={"type": "function", "function": {"name": "search"}})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert [n for n, _ in validate_calls(ch.message.tool_calls, ["search"])] == ["search"]


def test_agent_loop_sends_calls_and_results_back(server, client):
    """Turn 1 calls a tool; turn 2 carries that call and its result: the rendered prompt holds both (the
    call in the model's own format), as /tokenize renders it and as the completion's prompt ids show."""
    r1 = client.chat.completions.create(model="agent", messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=1.0, seed=3, max_tokens=400)
    calls = validate_calls(r1.choices[0].message.tool_calls)
    call = r1.choices[0].message.tool_calls[-1]
    convo = ASK + [r1.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
                   {"role": "user", "content": "And tomorrow?"}]
    r2 = client.chat.completions.create(model="agent", messages=convo, tools=TOOLS, temperature=0.0,
                                        max_tokens=8, extra_body={"return_token_ids": True})
    prompt = httpx.post(server.url + "/detokenize", timeout=30,
                        json={"tokens": r2.model_extra["prompt_token_ids"]}).json()["prompt"]
    # (the arguments reach the template parsed, as transformers' and the peers' servers hand them over)
    sent = re.findall(r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", prompt, re.S)
    assert [(n, json.loads(a)) for n, a in sent] == calls
    assert "<｜tool▁output▁begin｜>Sunny, 24 C<｜tool▁output▁end｜><｜User｜>And tomorrow?" in prompt
    tok = httpx.post(server.url + "/tokenize", timeout=30,
                     json={"messages": convo, "tools": TOOLS}).json()
    assert tok["tokens"] == r2.model_extra["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    assert r2.choices[0].model_extra["token_ids"] and len(r2.choices[0].model_extra["token_ids"]) <= 8


def test_response_formats_hold_on_noise(client):
    js = client.chat.completions.create(
        model="agent", messages=ASK, temperature=1.0, seed=1, max_tokens=300, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    for ch in js.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    obj = client.chat.completions.create(model="agent", messages=ASK, temperature=1.0, seed=2, max_tokens=300,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,6}-\d{3}"
    rx = client.chat.completions.create(model="agent", messages=ASK, temperature=1.0, seed=3, max_tokens=40,
                                        extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, rx.choices[0].message.content)
    ch = client.chat.completions.create(model="agent", messages=ASK, temperature=1.0, seed=4, max_tokens=20,
                                        extra_body={"structured_outputs": {"choice": ["sunny", "rain"]}})
    assert ch.choices[0].message.content in ("sunny", "rain")
    eb = client.completions.create(model="agent", prompt="Count:", temperature=1.0, seed=5, max_tokens=40,
                                   extra_body={"ebnf": 'root ::= "n=" [0-9] [0-9]? [0-9]? ";"'})
    assert re.fullmatch(r"n=[0-9]{1,3};", eb.choices[0].text)


def test_constraint_holds_after_free_reasoning(server, client):
    """thinking on: the reasoning is free text, then `</think>` opens the constrained answer (the bias on
    `</think>` only shortens the noise's reasoning)."""
    tid = str(httpx.post(server.url + "/tokenize", timeout=30,
                         json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"][0])
    seen_reasoning = False
    for seed in range(3):
        r = client.chat.completions.create(
            model="agent", messages=ASK, temperature=1.0, seed=seed, max_tokens=300, logit_bias={tid: 3.0},
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            extra_body={"chat_template_kwargs": {"thinking": True}})
        m = r.choices[0].message
        jsonschema.validate(json.loads(m.content), SCHEMA)
        seen_reasoning |= bool(m.model_extra.get("reasoning_content"))
    assert seen_reasoning, "no seed reasoned before answering"
    # streamed: reasoning deltas, then content deltas; SGLang's stream_reasoning false sends the reasoning
    # in one delta, once complete; both join to the unstreamed split
    kw = dict(model="agent", messages=ASK, temperature=1.0, seed=0, max_tokens=300, logit_bias={tid: 3.0},
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    whole = client.chat.completions.create(extra_body={"chat_template_kwargs": {"thinking": True}},
                                           **kw).choices[0].message
    for held in (False, True):
        parts: list[tuple[str, str]] = []
        for chunk in client.chat.completions.create(stream=True, extra_body={
                "chat_template_kwargs": {"thinking": True}, "stream_reasoning": not held}, **kw):
            for ch in chunk.choices:
                if ch.delta.model_extra.get("reasoning_content"):
                    parts.append(("r", ch.delta.model_extra["reasoning_content"]))
                if ch.delta.content:
                    parts.append(("c", ch.delta.content))
        kinds = [k for k, _ in parts]
        assert kinds == sorted(kinds, reverse=True), "content before the reasoning ended"
        assert "".join(s for k, s in parts if k == "r") == (whole.model_extra.get("reasoning_content") or "")
        assert "".join(s for k, s in parts if k == "c") == whole.content
        if held:
            assert kinds.count("r") <= 1


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"min_p": 2.0}, "min_p"),
])
def test_bad_agent_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "agent", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert kv_pages_used(server) == 0


def test_sampling_controls_are_accepted_and_deterministic(client):
    kw = dict(model="agent", messages=ASK, max_tokens=12, temperature=0.8, seed=9, presence_penalty=0.5,
              frequency_penalty=0.4, extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    a = client.chat.completions.create(**kw).choices[0].message.content
    assert a == client.chat.completions.create(**kw).choices[0].message.content
    # a large bias on one token makes it the greedy answer every step
    tid = 300
    r = client.completions.create(model="agent", prompt="x", max_tokens=4, temperature=0.0,
                                  logit_bias={str(tid): 100.0}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [tid] * 4


def test_generation_config_supplies_the_defaults(client):
    """The checkpoint's generation_config.json says temperature 0 and repetition_penalty 1.5: a request
    that sets neither gets both (vLLM's --generation-config auto), whatever its seed."""
    kw = dict(model="agent", prompt="The weather", max_tokens=32)
    a = client.completions.create(seed=1, **kw).choices[0].text
    assert a == client.completions.create(seed=2, **kw).choices[0].text
    assert a == client.completions.create(temperature=0.0, extra_body={"repetition_penalty": 1.5},
                                          **kw).choices[0].text
    assert a != client.completions.create(temperature=0.0, extra_body={"repetition_penalty": 1.0},
                                          **kw).choices[0].text


def test_tokens_routes(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}, timeout=30).json()["tokens"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert back.endswith("hello world")
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]

