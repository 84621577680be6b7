"""Two `splash serve --model tiny` behind SGLang's router (`sglang-router`, the Rust gateway), as SGLang's
users deploy several servers: `python -m sglang_router.launch_router --worker-urls A B --policy P`.

What the router (0.3.2) asks of a worker, and what is checked here:
- registration: GET /health (tried beside a gRPC probe: HTTP wins), then /server_info and /model_info
  (404 -> /get_server_info, /get_model_info) for its labels (model id = served_model_name); GET /workers
  lists the workers;
- routing: /generate, /v1/completions, /v1/chat/completions are parsed into its own request types and
  re-sent with SGLang's extra fields at their defaults (no_stop_trim, return_hidden_states, log_metrics, ...);
- load: GET /get_load, a JSON list whose entries' `num_tokens` it sums (-1 when that fails), polled every
  `--worker-startup-check-interval` s for power_of_two, and fanned out live by its own GET /get_loads;
- POST /flush_cache fans out to every worker.
Generation through the router (native and OpenAI routes, plain and streamed) equals direct.
The router would fetch a tokenizer for the worker's model path from the Hugging Face hub: HF_ENDPOINT points
it at a closed loopback port, so nothing leaves the machine.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_utils import LoopbackProcess, ServeProcess, free_port

pytest.importorskip("sglang_router", reason="sglang-router is not installed (it is in the dev extras: "
                                            "pip install -e '.[dev]')")

pytestmark = pytest.mark.timeout(300)

SERVE_ARGS = ["--model", "tiny", "--dtype", "float32", "--max-model-len", "256", "--num-kv-pages", "32",
              "--max-num-seqs", "4"]
PAGE_SIZE = 16  # the engine's default
POLICIES = ["cache_aware", "power_of_two"]
LOAD_POLL_S = 1  # the router polls /get_load this often (its --worker-startup-check-interval)
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # its log is coloured even into a file


class RouterProcess(LoopbackProcess):
    """`python -m sglang_router.launch_router` on a free loopback port; ready once /readiness counts every
    worker healthy. Its log is kept for failure messages."""

    name = "sglang-router"
    tail = 6000

    def __init__(self, worker_urls: list[str], policy: str, startup_timeout: float = 60.0) -> None:
        self.policy = policy
        self.want = len(worker_urls)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hf_home = tempfile.mkdtemp(prefix="sglang-router-hf-")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), "--worker-urls", *worker_urls, "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", str(LOAD_POLL_S), "--shutdown-grace-period-secs", "1",
               "--log-level", "info"]
        # its tokenizer lookup of model path "tiny" goes to the hub: a closed loopback port fails it at once
        env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1",
               "HF_HOME": self.hf_home}
        super().__init__(cmd, env, startup_timeout)

    def ready(self) -> bool:
        r = httpx.get(self.url + "/readiness", timeout=2.0)
        return r.status_code == 200 and r.json().get("healthy_workers") == self.want

    def output(self) -> str:
        return ANSI.sub("", super().output())

    def close(self) -> None:
        self.stop(timeout=15)
        shutil.rmtree(self.hf_home, ignore_errors=True)


@pytest.fixture(scope="module")
def servers():
    """Two identical servers, started side by side."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(ServeProcess, SERVE_ARGS) for _ in range(2)]
        concurrent.futures.wait(futs)
    started = [f.result() for f in futs if f.exception() is None]
    failed = [f.exception() for f in futs if f.exception() is not None]
    if failed:
        for s in started:
            s.close()
        raise failed[0]
    yield started
    for s in started:
        s.close()


@pytest.fixture(scope="module", params=POLICIES)
def router(request, servers):
    r = RouterProcess([s.url for s in servers], request.param)
    yield r
    r.close()
    Path(r.log.name).unlink(missing_ok=True)


@pytest.fixture
def router_log(request, router):
    """The router, whose log tail a failing test's report shows (teardown output is reported)."""
    failed = request.session.testsfailed
    yield router
    if request.session.testsfailed > failed:
        print(f"\n---- sglang-router ({router.policy}) log tail ----\n{router.output()}")


def _gen(url: str, body: dict, timeout: float = 60.0) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert r.status_code == 200, f"{url}/generate -> {r.status_code}: {r.text}"
    return r.json()


def _load(url: str) -> dict:
    r = httpx.get(url + "/get_load", timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and len(body) == 1, body
    return body[0]


def _router_loads(router: RouterProcess) -> dict[str, int]:
    r = httpx.get(router.url + "/get_loads", timeout=15)
    assert r.status_code == 200, r.text
    return {w["worker"]: w["load"] for w in r.json()["workers"]}


def _info(url: str) -> dict:
    r = httpx.get(url + "/get_server_info", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(pred, what: str, timeout: float = 15.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def _ids(seed: int, n: int) -> list[int]:
    return [1 + (seed * 37 + 11 * i) % 250 for i in range(n)]  # byte tokens, clear of the special ids


# ---- registration ---------------------------------------------------------------------------------

def test_router_registers_both_servers(router_log, servers):
    router = router_log
    listed = httpx.get(router.url + "/workers", timeout=10).json()
    by_url = {w["url"]: w for w in listed["workers"]}
    assert sorted(by_url) == sorted(s.url for s in servers), listed
    for w in by_url.values():
        assert w["is_healthy"] and w["connection_mode"] == "HTTP" and w["worker_type"] == "regular", w
        # its labels come from our /server_info (and model id from served_model_name)
        assert w["model_id"] == "tiny" and w["metadata"]["served_model_name"] == "tiny", w
        assert w["metadata"]["tp_size"] == "1" and w["metadata"]["disaggregation_mode"] == "null", w
    ready = httpx.get(router.url + "/readiness", timeout=10).json()
    assert ready == {"status": "ready", "healthy_workers": 2, "total_workers": 2}
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    # proxied to a worker
    assert httpx.get(router.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(router.url + "/get_model_info", timeout=10).json()
    assert info["served_model_name"] == "tiny" and info["is_generation"] is True
    assert httpx.get(router.url + "/get_server_info", timeout=10).json()["workers_count"] == 2  # its own
    models = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0).models.list()
    assert [m.id for m in models.data] == ["tiny"]


# ---- generation: the router changes nothing ----------------------------------------------------------

def test_generate_through_router_matches_direct(router_log, servers):
    router = router_log
    bodies = [{"input_ids": _ids(k, 5 + 7 * k), "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
              for k in range(4)]
    bodies += [{"text": t, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
               for t in ("Hello there, router", "The quick brown fox")]
    bodies.append({"input_ids": [_ids(7, 9), _ids(8, 4)],  # a batch
                   "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    for body in bodies:
        want = _gen(servers[0].url, body)
        other = _gen(servers[1].url, body)
        assert _strip_ids(want, other) == other  # the two servers agree
        got = _gen(router.url, body)
        assert _strip_ids(want, got) == got, (body, want, got)
    # streamed through the router: SSE passes through, the last event is the whole answer
    body = {**bodies[0], "stream": True}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == _gen(servers[0].url, bodies[0])["output_ids"]


def _strip_ids(want: dict | list, got: dict | list) -> dict | list:
    """`want` with the per-request fields of `got` (request id, latency, cache hits) copied in."""
    if isinstance(want, list):
        return [_strip_ids(w, g) for w, g in zip(want, got, strict=True)]
    meta = {**want["meta_info"]}
    for k in ("id", "e2e_latency", "cached_tokens"):
        meta[k] = got["meta_info"][k]
    return {**want, "meta_info": meta}


# sglang-router re-sends /v1/completions and /v1/chat/completions with SGLang's `no_stop_trim` and
# `return_hidden_states` (false), chat also `stream_reasoning` (true): splash/server/protocol.py refuses
# fields it does not know (400 unrecognized_argument). Drop the marks once it takes them.
def test_completions_through_router_matches_direct(router_log, servers):
    router = router_log
    direct = openai.OpenAI(base_url=servers[0].url + "/v1", api_key="none", max_retries=0, timeout=60)
    routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    # (the router's CompletionRequest takes text prompts only: token-id prompts are its own 422)
    for prompt in ("Hello there, router", "Once upon a time", "abc " * 20):
        want = direct.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        got = routed.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens
        streamed = routed.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.choices[0].text


def test_chat_through_router_matches_direct(router_log, servers):
    router = router_log
    direct = openai.OpenAI(base_url=servers[0].url + "/v1", api_key="none", max_retries=0, timeout=60)
    routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi there"}]
    want = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    got = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens
    streamed = routed.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        want.choices[0].message.content


# ---- load: what power_of_two and the router's /get_loads read ------------------------------------------

def test_get_load_counts_kv_tokens_the_router_sees(router_log, servers):
    router = router_log
    busy, idle = servers
    for s in servers:
        assert _load(s.url) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert _router_loads(router) == {busy.url: 0, idle.url: 0}

    prompt = _ids(3, 16)
    long_body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                                          "ignore_eos": True}}
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=_gen(busy.url, long_body, timeout=120)))
    t.start()
    paused = False
    try:
        # while it decodes its KV pages are held; pause in place to hold them still for the checks
        _wait(lambda: _load(busy.url)["num_tokens"] > len(prompt), "the long request's KV on /get_load")
        r = httpx.post(busy.url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
        assert r.status_code == 200, r.text
        paused = True
        load = _load(busy.url)
        assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0, load
        held = load["num_tokens"]
        assert held % PAGE_SIZE == 0 and len(prompt) < held <= len(prompt) + 200 + PAGE_SIZE, load
        v1 = httpx.get(busy.url + "/v1/loads", timeout=10).json()["loads"][0]
        assert v1["num_used_tokens"] == held and v1["num_running_reqs"] == 1
        assert _load(idle.url)["num_tokens"] == 0
        # the router's view (its live fan-out of /get_load) is the same figure
        assert _router_loads(router) == {busy.url: held, idle.url: 0}

        if router.policy == "power_of_two":
            # once its load monitor has polled, power-of-two picks the idle server every time (with two
            # workers it always compares both); one sent to the paused server would hang here
            time.sleep(2.5 * LOAD_POLL_S)
            before = {s.url: _info(s.url)["prompt_tokens_total"] for s in servers}
            for k in range(4):
                body = {"input_ids": _ids(20 + k, 8), "sampling_params": {"max_new_tokens": 4,
                                                                         "temperature": 0}}
                try:
                    _gen(router.url, body, timeout=20)
                except httpx.TimeoutException:
                    pytest.fail("power_of_two sent a request to the loaded (paused) server")
            after = {s.url: _info(s.url)["prompt_tokens_total"] for s in servers}
            assert after[busy.url] == before[busy.url]
            assert after[idle.url] - before[idle.url] == 4 * 8
    finally:
        if paused:
            httpx.post(busy.url + "/continue_generation", timeout=30)
        t.join(120)
    assert not t.is_alive()
    assert result["out"]["meta_info"]["completion_tokens"] == 200
    # finished: its pages went to the prefix cache, which counts as free
    _wait(lambda: _load(busy.url)["num_tokens"] == 0, "/get_load back to 0 once idle")
    assert _load(busy.url) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert _router_loads(router) == {busy.url: 0, idle.url: 0}


# ---- flush_cache fans out ---------------------------------------------------------------------------

def test_flush_cache_through_router_empties_both_prefix_caches(router_log, servers):
    router = router_log
    body = {"input_ids": _ids(9, 48), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for s in servers:
        _gen(s.url, body)
        again = _gen(s.url, body)["meta_info"]["cached_tokens"]
        assert again >= 32, f"{s.url}: the repeated prompt should hit the prefix cache, cached {again}"
        assert _info(s.url)["prefix_cache_blocks"] > 0
    r = httpx.post(router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success" and r.json()["workers_flushed"] == 2, r.json()
    for s in servers:
        assert _info(s.url)["prefix_cache_blocks"] == 0, s.url
        assert _gen(s.url, body)["meta_info"]["cached_tokens"] == 0, f"{s.url} still had the prefix"
