"""A live `splash serve --model tiny` on loopback, driven by the official `openai` client and raw HTTP.

One server (module scope) serves every test; it runs with a KV pool smaller than the context so both
"prompt longer than the context" and "prompt longer than the whole pool" are reachable.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import REPO, ServeProcess

API_KEY = "sk-splash-test"
MAX_MODEL_LEN = 256
PAGE_SIZE = 16  # the engine's default
NUM_KV_PAGES = 12  # a 192-token pool: smaller than the context on purpose
SERVE_ARGS = ["--model", "tiny", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
              "--num-kv-pages", str(NUM_KV_PAGES), "--max-num-seqs", "4",
              "--served-model-name", "tiny-test"]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    srv = ServeProcess(SERVE_ARGS, api_key=API_KEY)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def card(server) -> dict:
    r = httpx.get(server.url + "/v1/models", headers=_auth(), timeout=30)
    assert r.status_code == 200
    return r.json()["data"][0]


def _auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _metrics(url: str) -> dict[str, list]:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def _value(fams: dict[str, list], family: str, sample: str | None = None, **labels: str) -> float:
    total = 0.0
    found = False
    for s in fams.get(family, []):
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
            found = True
    assert found, f"no sample {sample or family} {labels} in /metrics"
    return total


# ---- the happy path through the official client -------------------------------------------------

def test_models_and_health(server, client, card):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["vocab_size"] > 0
    assert client.models.retrieve("tiny-test").id == "tiny-test"


def test_completion_greedy_is_deterministic_and_counts_usage(client):
    kw = dict(model="tiny-test", prompt="The quick brown fox", max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8
    assert a.usage.prompt_tokens > 0
    assert a.usage.total_tokens == a.usage.prompt_tokens + 8


def test_completion_prompt_shapes_and_n(client, card):
    ids = [5, 6, 7, 8]
    one = client.completions.create(model="tiny-test", prompt=ids, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.usage.prompt_tokens == len(ids)
    many = client.completions.create(model="tiny-test", prompt=[ids, [9, 10], ids], max_tokens=3, n=2,
                                     temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == list(range(6))
    assert many.usage.prompt_tokens == 2 * len(ids) + 2
    assert many.usage.completion_tokens == 6 * 3
    texts = client.completions.create(model="tiny-test", prompt=["a b", "c d"], max_tokens=2,
                                      extra_body={"ignore_eos": True})
    assert len(texts.choices) == 2
    # Greedy on the same ids gives the same continuation whichever batch it ran in.
    greedy = client.completions.create(model="tiny-test", prompt=[ids, [9, 10]], max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert greedy.choices[0].text == one.choices[0].text


def test_stop_string_cuts_the_text(client):
    kw = dict(model="tiny-test", prompt="Once upon a time", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[4:6]
    if len(full) < 6 or not stop.strip():
        pytest.skip(f"greedy text {full!r} too short to pick a stop string from")
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]


def test_completion_logprobs_top_k(client):
    r = client.completions.create(model="tiny-test", prompt="Hello", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and math.isfinite(chosen)
        assert 1 <= len(top) <= 2
        # Greedy picks the most likely token, so its logprob is the best of the top list.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_completion_and_logprobs(client):
    r = client.chat.completions.create(model="tiny-test", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_streaming_completion_matches_non_streaming(client):
    kw = dict(model="tiny-test", prompt="Streaming test", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streaming_chat(client):
    chunks = list(client.chat.completions.create(
        model="tiny-test", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model="tiny-test", messages=[
        {"role": "user", "content": "Tell me a story"}], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    assert streamed == full.choices[0].message.content


def test_raw_sse_format(server):
    body = {"model": "tiny-test", "prompt": [3, 4], "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    assert "usage" not in chunks[0]  # only present when stream_options.include_usage asks for it


# ---- bad input: 4xx in the OpenAI shape, and the server keeps serving ---------------------------

def _long_ids(n: int) -> list[int]:
    return [(7 * i) % 50 + 3 for i in range(n)]


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    # (id, path, body (dict, or str sent raw), headers override, status, param)
    ("invalid_json", CMPL, '{"prompt": "x",', None, 400, None),
    ("not_an_object", CMPL, "[1, 2]", None, 400, None),
    ("missing_prompt", CMPL, {"model": "tiny-test"}, None, 400, "prompt"),
    ("mistyped_max_tokens", CMPL, {"prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens"),
    ("mistyped_prompt", CMPL, {"prompt": {"text": "x"}}, None, 400, "prompt"),
    ("unknown_field", CMPL, {"prompt": "x", "max_token": 3}, None, 400, "max_token"),
    ("negative_temperature", CMPL, {"prompt": "x", "temperature": -0.5}, None, 400, "temperature"),
    ("nan_temperature", CMPL, '{"prompt": "x", "temperature": NaN}', None, 400, "temperature"),
    ("top_p_zero", CMPL, {"prompt": "x", "top_p": 0}, None, 400, "top_p"),
    ("top_k_negative", CMPL, {"prompt": "x", "top_k": -5}, None, 400, "top_k"),
    ("n_zero", CMPL, {"prompt": "x", "n": 0}, None, 400, "n"),
    ("max_tokens_zero", CMPL, {"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
    ("logprobs_too_many", CMPL, {"prompt": "x", "logprobs": 50}, None, 400, "logprobs"),
    ("empty_prompt", CMPL, {"prompt": ""}, None, 400, "prompt"),
    ("empty_ids", CMPL, {"prompt": []}, None, 400, "prompt"),
    ("id_out_of_vocab", CMPL, {"prompt": [1, 10**9]}, None, 400, "prompt"),
    ("prompt_over_context", CMPL, {"prompt": _long_ids(MAX_MODEL_LEN + 10)}, None, 400, "prompt"),
    ("prompt_over_kv_pool", CMPL, {"prompt": _long_ids(NUM_KV_PAGES * PAGE_SIZE + 8)}, None,
     400, "prompt"),
    ("max_tokens_over_context", CMPL, {"prompt": [5], "max_tokens": 10 * MAX_MODEL_LEN}, None,
     400, "max_tokens"),
    ("stream_with_bad_value", CMPL, {"prompt": "x", "stream": True, "top_p": 2}, None, 400, "top_p"),
    ("unknown_model", CMPL, {"prompt": "x", "model": "gpt-17"}, None, 404, "model"),
    ("bad_api_key", CMPL, {"prompt": "x"}, _auth("wrong"), 401, None),
    ("missing_api_key", CMPL, {"prompt": "x"}, {}, 401, None),
    ("chat_no_messages", CHAT, {"messages": []}, None, 400, "messages"),
    ("chat_bad_role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("chat_image_part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None,
     400, "messages[0].content[0].type"),
    ("chat_top_logprobs_alone", CHAT,
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("chat_max_completion_tokens_over_context", CHAT,
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, None, 400,
     "max_completion_tokens"),
    ("chat_unknown_model", CHAT,
     {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, None, 404, "model"),
    ("unknown_route", "/v1/embeddings", {"input": "x"}, None, 404, None),
]


@pytest.mark.parametrize("path,body,headers,status,param", [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_4xx_in_openai_shape_and_server_survives(server, path, body, headers, status, param):
    hdrs = _auth() if headers is None else headers
    if isinstance(body, str):
        r = httpx.post(server.url + path, content=body, headers={**hdrs, "content-type": "application/json"},
                       timeout=60)
    else:
        r = httpx.post(server.url + path, json=body, headers=hdrs, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    # ... and the next good request is served.
    ok = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=60,
                    json={"model": "tiny-test", "prompt": [5, 6, 7], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_oversized_body_is_refused_before_reading(server):
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999999\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_openai_client_raises_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-test", prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- metrics, disconnects, shutdown ---------------------------------------------------------------

def test_metrics_parse_and_count(server, client):
    before = _metrics(server.url)
    client.completions.create(model="tiny-test", prompt="count me", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    fams = _metrics(server.url)
    gen = "splash:generation_tokens"
    assert _value(fams, gen, model_name="tiny-test") - _value(before, gen, model_name="tiny-test") == 4
    assert _value(fams, "splash:prompt_tokens") > _value(before, "splash:prompt_tokens")
    for hist in ("splash:time_to_first_token_seconds", "splash:inter_token_latency_seconds",
                 "splash:e2e_request_latency_seconds"):
        assert _value(fams, hist, hist + "_count") > 0
    assert _value(fams, "splash:num_requests_running") == 0
    assert _value(fams, "splash:num_requests_waiting") == 0
    assert _value(fams, "splash:kv_cache_usage_perc") == 0
    assert _value(fams, "splash:ranks") == 1
    assert _value(fams, "splash:layout", layout="tp") == 1
    assert _value(fams, "splash:kv_pool_tokens_per_rank", rank="0") == NUM_KV_PAGES * PAGE_SIZE
    assert _value(fams, "splash:kv_distinct_tokens") == NUM_KV_PAGES * PAGE_SIZE  # T = 1: one pool
    assert _value(fams, "splash:request_success", finished_reason="length") > 0


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    before = _metrics(server.url)
    aborted_before = sum(s.value for s in before.get("splash:request_success", [])
                         if s.labels.get("finished_reason") == "abort")
    sampled_before = _value(before, "splash:engine_generated_tokens")
    body = {"model": "tiny-test", "prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True,
            "stream": True}
    seen = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                seen += 1
                if seen == 2:
                    fams = _metrics(server.url)
                    assert _value(fams, "splash:num_requests_running") == 1
                    assert _value(fams, "splash:kv_cache_usage_perc") > 0
                    break
    assert seen == 2
    deadline = time.monotonic() + 30
    while True:
        fams = _metrics(server.url)
        idle = (_value(fams, "splash:num_requests_running") == 0
                and _value(fams, "splash:num_requests_waiting") == 0
                and _value(fams, "splash:kv_cache_usage_perc") == 0)
        if idle:
            break
        assert time.monotonic() < deadline, "the abandoned request still holds the engine"
        time.sleep(0.1)
    aborted = _value(fams, "splash:request_success", finished_reason="abort")
    assert aborted == aborted_before + 1
    # The engine stopped sampling for it: fewer than the 150 tokens asked for, and no more since.
    sampled = _value(fams, "splash:engine_generated_tokens") - sampled_before
    assert 2 <= sampled < 150
    time.sleep(0.5)
    assert _value(_metrics(server.url), "splash:engine_generated_tokens") - sampled_before == sampled
    ok = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=60,
                    json={"model": "tiny-test", "prompt": [8, 9], "max_tokens": 2})
    assert ok.status_code == 200


def test_port_in_use_fails_fast_with_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "splash", "serve", "--model", "tiny", "--port", str(port)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "cannot listen" in r.stderr and "Traceback" not in r.stderr


def test_sigterm_drains_open_streams_and_exits_0(server):
    body = {"model": "tiny-test", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                break
        server.proc.send_signal(signal.SIGTERM)  # mid-stream: the open request may finish
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert sum('"finish_reason":"length"' in e for e in events) == 1
    code = server.stop(signal.SIGTERM, timeout=60)
    assert code == 0, server.output()
    assert "server stopped" in server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
