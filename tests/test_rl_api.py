"""SGLang's native API on a live `splash serve` (2 ranks, DOP, float64) driven over HTTP, as an RL
framework drives it: /generate with token ids and logprobs equal to transformers' (1e-9) before and
after updates from disk and from a trainer's broadcast; abort with partial outputs; pause modes;
memory release that lowers the server's RSS; routed experts; the API key; every bad input a 400.

One server serves the whole module (checkpoints A and B of one config, A loaded at start).
"""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import pytest
from rl_utils import Trainer, two_checkpoints
from serve_utils import ServeProcess

from splash.distributed.launch import free_port

# (one torch thread: transformers' float32 router rounds differently when its GEMMs are split over threads)
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

KEY = "sk-rl"
NEW = 5
PROMPTS = [[5, 6, 7], list(range(10, 29)), [90, 1, 33, 4, 8, 61, 17]]
PAGES = 4096  # ~88 MiB of float64 KV per rank: a release must show in the RSS
POOL_BYTES = PAGES * 16 * 3 * (24 + 32) * 8  # pages * page size * layers * latent dim * 8 bytes
TOL = 1e-9


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return two_checkpoints(tmp_path_factory, PROMPTS, NEW)


@pytest.fixture(scope="module")
def server(ckpts):
    srv = ServeProcess(["--model", ckpts["A"][0], "--dtype", "float64", "--tp", "2", "--layout", "dop",
                        "--num-kv-pages", str(PAGES), "--max-num-seqs", "8", "--device", "cpu",
                        "--enable-memory-saver", "--log-level", "info"], api_key=KEY)
    yield srv
    srv.close()


def post(server, path: str, body: dict | None = None, key: str | None = KEY, timeout: float = 120):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body or {}, headers=h, timeout=timeout)


def get(server, path: str) -> httpx.Response:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def greedy_batch(server, **extra) -> list[dict]:
    r = post(server, "/generate", {"input_ids": PROMPTS, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                       "ignore_eos": True}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def check(objs: list[dict], ref, what: str, version: str | None = None) -> None:
    toks, lps, _ = ref
    assert [o["output_ids"] for o in objs] == toks, what
    for o, want in zip(objs, lps):
        got = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        assert [x[1] for x in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert max(abs(x - y) for x, y in zip(got, want)) < TOL, what
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}
        assert o["meta_info"]["prompt_tokens"] == len(PROMPTS[o["index"]])
        assert o["meta_info"]["completion_tokens"] == NEW
        if version is not None:
            assert o["meta_info"]["weight_version"] == version


def info(server) -> dict:
    r = get(server, "/get_server_info")
    assert r.status_code == 200
    return r.json()


def test_generate_and_updates_match_transformers(server, ckpts):
    (a, ra), (b, rb) = ckpts["A"], ckpts["B"]
    check(greedy_batch(server), ra, "A at start", "default")
    r = post(server, "/update_weights_from_disk", {"model_path": b, "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    check(greedy_batch(server), rb, "B from disk", "step-1")
    assert info(server)["weight_version"] == "step-1"
    assert get(server, "/get_model_info").json()["weight_version"] == "step-1"
    # a trainer process broadcasts A: init the group (blocks until both sides joined), then update
    port = free_port()
    tr = Trainer(a, port, 3, "rl").start()
    r = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                    "rank_offset": 1, "world_size": 3, "group_name": "rl",
                                                    "backend": "gloo"})
    assert r.status_code == 200 and r.json()["success"], r.text
    tr.go.set()
    r = post(server, "/update_weights_from_distributed", {**tr.meta, "weight_version": "step-2"})
    tr.join()
    assert r.status_code == 200 and r.json()["success"], r.text
    check(greedy_batch(server), ra, "A from the trainer's broadcast", "step-2")
    # refused updates name the tensor and keep the weights
    bad = {**tr.meta, "shapes": [[1, 2]] + tr.meta["shapes"][1:]}
    r = post(server, "/update_weights_from_distributed", {**bad, "dtypes": ["int4"] + bad["dtypes"][1:]})
    assert r.status_code == 400 and "int4" in r.json()["message"] and not r.json()["success"]
    r = post(server, "/destroy_weights_update_group", {"group_name": "rl"})
    assert r.status_code == 200, r.text
    r = post(server, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert r.status_code == 400 and "/no/such/dir" in r.json()["message"]
    check(greedy_batch(server), ra, "after refused updates", "step-2")


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"input_ids": [1, 2], "text": "x"}, "exactly one"),
    ("/generate", {}, "exactly one"),
    ("/generate", {"input_ids": [1, 500]}, "outside the vocabulary"),
    ("/generate", {"input_ids": []}, "empty"),
    ("/generate", {"text": "hello"}, "tokenizer"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, "context"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"min_p": 1.5}}, "min_p"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, "temprature"),
    ("/generate", {"input_ids": [[1, 2], [3]], "rid": "one"}, "rid"),
    ("/generate", {"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "unique"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "start below 2"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 0}}, "n"),
    ("/abort_request", {}, "rid"),
    ("/pause_generation", {"mode": "soon"}, "pause mode"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/tmp", "load_format": "gguf"}, "load_format"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                          "group_name": "none"}, "no weight-update group"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": [], "shapes": []}, "one length"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2}, "rank_offset"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 3, "backend": "mpi"}, "backend"),
    ("/destroy_weights_update_group", {"group_name": "none"}, "none"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "memory tag"),
])
def test_bad_input_is_400_and_names_the_problem(server, path, body, needle):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    j = r.json()
    msg = j["error"]["message"] if "error" in j else j["message"]
    assert needle in msg, msg
    assert get(server, "/health_generate").status_code == 200  # still serving, nothing held or leaked
    assert info(server)["kv_pages_used"] == 0


def test_every_route_needs_the_key(server):
    for path in ("/generate", "/abort_request", "/pause_generation", "/continue_generation",
                 "/update_weights_from_disk", "/init_weights_update_group",
                 "/update_weights_from_distributed", "/update_weights_from_tensor",
                 "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache"):
        r = post(server, path, {}, key=None)
        assert r.status_code == 401, path
        assert post(server, path, {}, key="wrong").status_code == 401
    for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info", "/health_generate",
                 "/get_weight_version", "/v1/loads"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401, path
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def _long(server, rid: str, out: dict, n: int = 400) -> threading.Thread:
    def go() -> None:
        out[rid] = post(server, "/generate", {"input_ids": PROMPTS[1], "rid": rid,
                                              "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                  "ignore_eos": True}})
    t = threading.Thread(target=go)
    t.start()
    return t


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _generated(server) -> int:
    return info(server)["generation_tokens_total"]


def test_abort_one_and_all_end_with_partial_outputs(server):
    out: dict = {}
    g0 = _generated(server)
    threads = [_long(server, "long-1", out), _long(server, "long-2", out), _long(server, "long-3", out)]
    _wait(lambda: _generated(server) > g0 + 6, "tokens")
    r = post(server, "/abort_request", {"rid": "long-1"})
    assert r.status_code == 200
    threads[0].join(60)
    one = out["long-1"]
    assert one.status_code == 200
    m = one.json()["meta_info"]
    assert m["finish_reason"]["type"] == "abort" and m["id"] == "long-1"
    assert 0 < len(one.json()["output_ids"]) < 400 and m["completion_tokens"] == len(one.json()["output_ids"])
    r = post(server, "/abort_request", {"abort_all": True})
    assert r.status_code == 200 and r.json()["num_aborted"] == 2
    for t in threads[1:]:
        t.join(60)
    for rid in ("long-2", "long-3"):
        assert out[rid].status_code == 200
        assert out[rid].json()["meta_info"]["finish_reason"]["type"] == "abort"
    _wait(lambda: info(server)["num_requests"] == 0, "requests gone")
    assert info(server)["kv_pages_used"] == 0


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_resumes_running_requests_with_identical_tokens(server, mode):
    out: dict = {}
    ref = post(server, "/generate", {"input_ids": PROMPTS[1], "sampling_params": {
        "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
    g0 = _generated(server)
    t = _long(server, f"p-{mode}", out, n=60)
    _wait(lambda: _generated(server) > g0 + 3, "tokens")
    r = post(server, "/pause_generation", {"mode": mode})
    assert r.status_code == 200 and r.json()["success"]
    st = info(server)
    assert st["paused"] and (st["kv_pages_used"] == 0) == (mode == "retract")
    frozen = _generated(server)
    assert get(server, "/health_generate").status_code == 503  # paused: it would never generate
    time.sleep(0.3)
    assert _generated(server) == frozen and t.is_alive()
    assert post(server, "/continue_generation").status_code == 200
    t.join(60)
    assert out[f"p-{mode}"].json()["output_ids"] == ref


def test_pause_abort_ends_running_requests(server):
    out: dict = {}
    g0 = _generated(server)
    t = _long(server, "pa", out)
    _wait(lambda: _generated(server) > g0 + 3, "tokens")
    r = post(server, "/pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 1
    t.join(60)
    assert out["pa"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    # new requests wait while paused, then run
    t2 = _long(server, "after", out, n=3)
    time.sleep(0.3)
    assert t2.is_alive()
    assert post(server, "/continue_generation").status_code == 200
    t2.join(60)
    assert out["after"].json()["meta_info"]["finish_reason"]["type"] == "length"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_release_and_resume_memory(server, ckpts):
    before = greedy_batch(server)
    pid = server.proc.pid  # rank 0's process
    rss0 = _rss_mib(pid)
    r = post(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["success"]
    drop = rss0 - _rss_mib(pid)
    assert drop > 0.8 * POOL_BYTES / 2**20, (rss0, drop)
    out: dict = {}
    t = _long(server, "released", out, n=NEW)
    time.sleep(0.3)
    assert t.is_alive(), "a request while released must wait"
    assert get(server, "/health_generate").status_code == 503
    r = post(server, "/update_weights_from_disk", {"model_path": ckpts["B"][0]})
    assert r.status_code == 400 and "released" in r.json()["message"]
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    t.join(60)
    assert out["released"].json()["output_ids"] == before[1]["output_ids"]
    assert [o["output_ids"] for o in greedy_batch(server)] == [o["output_ids"] for o in before]


def test_stream_routed_experts_and_info(server, ckpts):
    r = httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"input_ids": PROMPTS[0], "stream": True, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    # cumulative; a slow reader may get two tokens in one chunk (SGLang streams the latest state too)
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens[0] >= 1 and lens[-1] == NEW and all(a < b for a, b in zip(lens, lens[1:])), lens
    assert all(c["output_ids"] == chunks[-1]["output_ids"][:len(c["output_ids"])] for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    objs = greedy_batch(server, return_routed_experts=True)
    current = ckpts["A"][1]  # the weights left by the update test (and after resume)
    for o, want in zip(objs, current[2]):
        m = o["meta_info"]
        arr = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype=np.int32).reshape(
            m["routed_experts_shape"])  # SGLang's layout: every layer (the dense first one all 0) x top-k
        assert arr.shape == (want.shape[0], 3, want.shape[2]) and (arr[:, 0] == 0).all()
        assert (arr[:, 1:] == want.numpy()).all()
    # sampled (temperature 1): ignore_eos, or a sample may end after one token
    r = post(server, "/generate", {"input_ids": PROMPTS[0],
                                   "sampling_params": {"n": 3, "max_new_tokens": 2, "ignore_eos": True},
                                   "return_logprob": True, "top_logprobs_num": 2})
    objs = r.json()
    assert [o["index"] for o in objs] == [0, 1, 2] and all(len(o["output_ids"]) == 2 for o in objs)
    assert all(len(t) == 2 for o in objs for t in o["meta_info"]["output_top_logprobs"])
    st = info(server)
    assert st["tp_size"] == 2 and st["layout"] == "dop" and "weight_version" in st
    assert get(server, "/get_weight_version").json()["weight_version"] == st["weight_version"]
    r = post(server, "/flush_cache")
    assert r.status_code == 200 and r.json()["success"]


def test_text_prompts_stop_strings_and_batches_on_the_tiny_model():
    """The text side (tokenizer, stop strings, no_stop_trim) in-process on the tiny model, one rank."""
    from fastapi.testclient import TestClient

    from splash.engine.async_engine import AsyncEngine
    from splash.server.app import create_app

    eng = AsyncEngine.from_args(model="tiny", dtype="float32", num_kv_pages=64, device="cpu")
    with TestClient(create_app(eng, api_key=KEY)) as c:
        h = {"Authorization": f"Bearer {KEY}"}
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        full = c.post("/generate", headers=h, json={"text": "hello", "sampling_params": sp}).json()
        assert full["meta_info"]["finish_reason"]["type"] == "length" and len(full["output_ids"]) == 12
        stop = full["text"][3:5]
        cut = c.post("/generate", headers=h, json={"text": "hello", "sampling_params": {**sp, "stop": stop}})
        m = cut.json()["meta_info"]
        assert m["finish_reason"] == {"type": "stop", "matched": stop}
        assert full["text"].startswith(cut.json()["text"]) and stop not in cut.json()["text"]
        keep = {**sp, "stop": stop, "no_stop_trim": True}
        kept = c.post("/generate", headers=h, json={"text": "hello", "sampling_params": keep})
        assert kept.json()["text"].endswith(stop)
        tid = full["output_ids"][2]
        r = c.post("/generate", headers=h,
                   json={"text": "hello", "sampling_params": {**sp, "stop_token_ids": [tid]}})
        assert r.json()["output_ids"][-1] == tid and r.json()["meta_info"]["finish_reason"]["matched"] == tid
        batch = c.post("/generate", headers=h, json={"text": ["hello", "hi there"], "rid": ["a", "b"],
                                                     "return_logprob": True, "return_text_in_logprobs": True,
                                                     "sampling_params": [sp, {**sp, "n": 2}]}).json()
        assert [o["index"] for o in batch] == [0, 1, 2]
        assert [o["meta_info"]["id"] for o in batch] == ["a", "b", "b"]
        assert batch[0]["output_ids"] == full["output_ids"]
        assert all(isinstance(x[2], str) for x in batch[0]["meta_info"]["output_token_logprobs"])
        assert c.post("/abort_request", headers=h, json={"rid": "not-running"}).status_code == 200
        assert c.get("/health_generate", headers=h).status_code == 200
