"""Prefill/decode disaggregation behind sglang-router with several servers, and the request features whose
first token the prefill samples and whose rest the decode does.

Two prefills (P1, P2, each its own bootstrap port) and two decodes (D1, D2) of one checkpoint (the agent
checkpoint of tests/helpers_agent.py: DeepSeek-V3.1's tool format on tiny's random weights, float64,
--check-books), started once; router A is 2P1D (P1, P2 -> D1), router B 1P2D (P1 -> D1, D2), both round
robin, so every server takes part. The reference is D1 answering the same body without bootstrap fields
(colocated). Checked: tokens (and logprobs) equal the reference through both routers; n > 1 (an RL
group: one room, n sequences, each continuing from its own first token) greedy and seeded; stop strings,
response_format json_schema and tool_choice required (the prefill's first token is under the grammar);
a client that leaves a stream through the router frees both sides.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from helpers_agent import TOOLS, write_agent_checkpoint
from serve_utils import ServeProcess, free_port
from test_pd_server import PDRouter, _counter, _loads, _mooncake_ok, _pd_direct, _post

pytestmark = pytest.mark.timeout(300)

SERVE = ["--dtype", "float64", "--max-model-len", "1024", "--num-kv-pages", "160", "--max-num-seqs", "8",
         "--check-books", "--served-model-name", "agent"]
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 31, 64, 2, 19, 77, 101, 13, 6, 44, 91, 120, 9], [11, 12, 13],
           [40, 41, 42, 43, 44, 45, 46, 47, 48], [300, 7, 301, 9, 302, 11, 303]]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (dev extras)")
    if not _mooncake_ok():
        pytest.skip("the Mooncake transfer engine does not import: run `make setup`")
    args = ["--model", write_agent_checkpoint(tmp_path_factory.mktemp("pd") / "agent"), *SERVE]
    boots = [free_port(), free_port()]
    roles = [["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(b)] for b in boots]
    roles += [["--disaggregation-mode", "decode"]] * 2
    procs: list = []
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as ex:  # (started side by side: one wait, not four)
            futures = [ex.submit(ServeProcess, [*args, *role]) for role in roles]
            errors = []
            for f in futures:
                try:
                    procs.append(f.result())
                except Exception as e:  # noqa: BLE001 - the others are closed below, then it is raised
                    errors.append(e)
            if errors:
                raise errors[0]
        p1, p2, d1, d2 = procs
        procs.append(PDRouter([(p1.url, boots[0]), (p2.url, boots[1])], [d1.url], "--policy", "round_robin"))
        procs.append(PDRouter([(p1.url, boots[0])], [d1.url, d2.url], "--policy", "round_robin"))
        yield SimpleNamespace(p=[p1, p2], d=[d1, d2], boots=boots, a=procs[4], b=procs[5])
    finally:
        for p in reversed(procs):
            p.close()


def settled(cluster, timeout: float = 20.0) -> None:
    """Every server has no request and no page held (bounded wait: a release may still be on its way)."""
    for s in (*cluster.p, *cluster.d):
        deadline = time.monotonic() + timeout
        while ((load := _loads(s.url))["num_total_reqs"] or load["num_used_tokens"]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (load["num_total_reqs"], load["num_used_tokens"]) == (0, 0), (s.url, load)


def _lps(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def test_2p1d_and_1p2d_answer_as_colocated(cluster):
    d1 = cluster.d[0]
    bodies = [{"input_ids": ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
              for ids in PROMPTS]
    refs = [_post(d1.url, "/generate", b).json() for b in bodies]
    for router, spread in ((cluster.a, cluster.p), (cluster.b, cluster.d)):
        before = [_counter(s.url, "splash:kv_transfers_total") for s in spread]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda b: _post(router.url, "/generate", b), bodies))  # noqa: B023
        assert [r.status_code for r in outs] == [200] * 4, [r.text for r in outs] + [router.output()[-2000:]]
        for got, ref in zip(outs, refs):
            assert got.json()["output_ids"] == ref["output_ids"]
            assert _lps(got.json()) == pytest.approx(_lps(ref), abs=1e-12)  # (the router re-encodes floats)
        after = [_counter(s.url, "splash:kv_transfers_total") for s in spread]
        assert all(a > b for a, b in zip(after, before)), (before, after)  # (round robin: each one took part)
    settled(cluster)


def test_n_samples_share_one_room(cluster):
    """An RL group (n > 1): one body, one room; every sample equal to the colocated server's."""
    d1, p2, d2 = cluster.d[0], cluster.p[1], cluster.d[1]
    # (temperature and top_p exact in float32: the router passes them on as float32, 0.9 would not be;
    # the reference is D1 without a prefix cache, the prefill shares the prompt's pages: rows batch
    # differently, so logprobs to 1e-12 - bit-exact with equal settings: tests/test_pd_engine.py)
    for sp in ({"n": 8, "temperature": 0.0},
               {"n": 4, "temperature": 0.75, "top_p": 0.875, "sampling_seed": 11}):
        body = {"input_ids": PROMPTS[0], "return_logprob": True,
                "sampling_params": {**sp, "max_new_tokens": 6, "ignore_eos": True}}
        ref = _post(d1.url, "/generate", body).json()
        assert len(ref) == sp["n"]
        direct = _pd_direct(p2, d2, cluster.boots[1], body)  # (the two halves posted as the router does)
        assert [o["output_ids"] for o in direct] == [o["output_ids"] for o in ref]
        for g, r in zip(direct, ref):
            assert _lps(g) == pytest.approx(_lps(r), abs=1e-12)
        got = _post(cluster.a.url, "/generate", body)
        assert got.status_code == 200, got.text
        assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in ref]
        for g, r in zip(got.json(), ref):
            assert _lps(g) == pytest.approx(_lps(r), abs=1e-12)
        if sp["temperature"] == 0.0:
            assert len({o["output_ids"][0] for o in ref}) == 1
    settled(cluster)


def _chat(url: str, **kw) -> dict:
    r = _post(url, "/v1/chat/completions", {"model": "agent", "temperature": 0.0, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_stop_strings_json_schema_and_tools_cross_the_halves(cluster):
    d1, router = cluster.d[0], cluster.b
    # stop strings: one inside the first tokens' text (the prefill sampled the first), one later
    body = {"model": "agent", "prompt": "the weather in Paris", "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}
    text = _post(d1.url, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(text) >= 8, text
    for stop in (text[:2], text[5:8]):
        ref = _post(d1.url, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
        got = _post(router.url, "/v1/completions", {**body, "stop": [stop]})
        assert got.status_code == 200, got.text
        got = got.json()["choices"][0]
        assert (got["text"], got["finish_reason"]) == (ref["text"], ref["finish_reason"]) and \
            ref["finish_reason"] == "stop", (stop, ref)
    # structured output: the prefill draws the first token under the grammar, the decode the rest
    ask = [{"role": "user", "content": "Describe a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    ref = _chat(d1.url, messages=ask, response_format=fmt, max_tokens=200)["message"]["content"]
    got = _chat(router.url, messages=ask, response_format=fmt, max_tokens=200)["message"]["content"]
    assert got == ref
    jsonschema.validate(json.loads(got), SCHEMA)
    # tool_choice required (a structural tag over the tool-call format)
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    calls = []
    for url in (d1.url, router.url):
        ch = _chat(url, messages=ask, tools=TOOLS, tool_choice="required", max_tokens=300)
        assert ch["finish_reason"] == "tool_calls", ch
        calls.append([(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in ch["message"]["tool_calls"]])
    assert calls[0] == calls[1] and calls[0]
    settled(cluster)


def test_a_client_leaving_a_stream_through_the_router_frees_both_sides(cluster):
    d1 = cluster.d[0]
    made = _counter(d1.url, "splash:generation_tokens_total")
    body = {"input_ids": PROMPTS[0], "stream": True,
            "sampling_params": {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True}}
    seen = 0
    with httpx.stream("POST", cluster.a.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # (leaving the block closes the connection: the client is gone)
    settled(cluster)
    # the decode stopped early: the router passed the disconnect on, the request was aborted
    assert _counter(d1.url, "splash:generation_tokens_total") - made < 900
