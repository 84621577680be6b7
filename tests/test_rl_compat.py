"""The RL/eval compatibility surface in one process (T=1, float64): SGLang's server info and /v1/loads,
custom_params (top-p replay: kept sets, and logprobs renormalised over them as transformers' logits give),
routed experts of every layer from a start, input_token_logprobs, the memory-saver flag,
/update_weights_from_tensor from another process's shared memory and every bad payload (refused, nothing
changed), output logprobs never null under abort, retract and KV-pressure preemption, OpenAI echo on a
tokenizer, and `splash.Engine` (SGLang's in-process shape) returning the server's bodies.
Transformers gives the reference; the 2-rank, slime-shaped run is tests/test_slime_conformance.py.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from helpers_ckpt import hf_logits, hf_reference
from rl_utils import two_checkpoints
from safetensors.torch import load_file

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

KEY = "sk-compat"
H = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [list(range(10, 29)), [90, 1, 33, 4, 8, 61, 17]]
NEW = 5
TOL = 1e-9
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, num_kv_pages=48, device="cpu")
SENDER = Path(__file__).with_name("tensor_sender.py")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return two_checkpoints(tmp_path_factory, PROMPTS, NEW)


@pytest.fixture(scope="module")
def client(ckpts):
    from splash.engine.async_engine import AsyncEngine
    from splash.server.app import create_app

    eng = AsyncEngine.from_args(model=ckpts["A"][0], **ENGINE)
    eng.engine.memory_saver = False  # as `splash serve` starts without --enable-memory-saver
    with TestClient(create_app(eng, api_key=KEY)) as c:
        yield c


def gen(c, **body) -> dict | list:
    r = c.post("/generate", headers=H, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(**extra) -> dict:
    return {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True, **extra}


def int32s(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=np.int32)


def stats(c) -> dict:
    return c.get("/get_server_info", headers=H).json()


def test_routes_need_the_key_and_info_is_sglangs(client):
    for path in ("/server_info", "/get_server_info", "/model_info", "/v1/loads", "/get_weight_version"):
        assert client.get(path).status_code == 401, path
    assert client.post("/update_weights_from_tensor", json={}).status_code == 401
    info = client.get("/server_info", headers=H).json()
    want = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "dtype": "float64",
            "kv_cache_dtype": "auto",
            "enable_memory_saver": False, "enable_return_routed_experts": True, "disable_radix_cache": False,
            "page_size": 4, "max_running_requests": 8, "disaggregation_mode": "null", "encoder_only": False,
            "skip_tokenizer_init": True, "speculative_algorithm": None}
    assert {k: info.get(k) for k in want} == want and "api_key" not in info
    assert info["max_total_num_tokens"] == 48 * 4 and info["weight_version"] == "default"
    assert client.get("/model_info", headers=H).json()["is_generation"] is True
    load = client.get("/v1/loads?include=core,memory", headers=H).json()
    assert load["loads"][0]["num_total_reqs"] == 0 and "memory" in load["loads"][0]
    r = client.get("/v1/loads?include=gpu", headers=H)
    assert r.status_code == 400 and "gpu" in r.json()["error"]["message"]
    # without --enable-memory-saver nothing is released, and the answer says which flag to start with
    r = client.post("/release_memory_occupation", headers=H, json={})
    assert r.status_code == 400 and "--enable-memory-saver" in r.json()["message"]
    assert stats(client)["memory_released"] == [] and not stats(client)["paused"]


def test_top_p_replay_matches_transformers(client, ckpts):
    """custom_params.return_top_p_token_ids: each token's kept set, and logprobs of softmax(logits / T)
    renormalised over it (slime's trainer replays that truncation); unknown custom keys are ignored."""
    hf = hf_reference(ckpts["A"][0])
    sp = {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.8, "top_k": -1, "n": 2, "sampling_seed": 7,
          "custom_params": {"return_top_p_token_ids": True, "some_logit_processor_arg": 3}}
    objs = gen(client, input_ids=PROMPTS[1], sampling_params=sp, return_logprob=True)
    for o in objs:
        m = o["meta_info"]
        ids, offs = int32s(m["top_p_token_ids"]), int32s(m["top_p_token_offsets"])
        assert len(offs) == len(o["output_ids"]) + 1 and offs[-1] == len(ids)
        logits = hf_logits(hf, PROMPTS[1] + o["output_ids"][:-1])[len(PROMPTS[1]) - 1:]
        for j, (lp, t, _) in enumerate(m["output_token_logprobs"]):
            probs = torch.softmax(logits[j] / 0.7, -1)
            order = probs.argsort(descending=True)
            before = probs[order].cumsum(0) - probs[order]
            nucleus = order[(before < 0.8) | (torch.arange(len(order)) == 0)].tolist()
            kept = ids[offs[j]:offs[j + 1]].tolist()
            assert kept == nucleus and t in kept
            assert abs(lp - float(torch.log(probs[t] / probs[nucleus].sum()))) < TOL
    for bad, needle in (({"return_top_p_token_ids": "yes"}, "true or false"), (None, "needs top_p")):
        body = {**sp, "top_p": 1.0, "custom_params": {"return_top_p_token_ids": True}} if bad is None else \
            {**sp, "custom_params": bad}
        r = client.post("/generate", headers=H, json={"input_ids": PROMPTS[1], "sampling_params": body})
        assert r.status_code == 400 and needle in r.text
    assert stats(client)["kv_pages_used"] == 0


def test_routed_experts_every_layer_and_input_logprobs(client, ckpts):
    _, (toks, _, routes) = ckpts["A"]
    o = gen(client, input_ids=PROMPTS[0], sampling_params=greedy(), return_routed_experts=True,
            routed_experts_start_len=3, return_logprob=True, logprob_start_len=2, top_logprobs_num=1)
    m = o["meta_info"]
    assert o["output_ids"] == toks[0] and m["routed_experts_start_len"] == 3
    arr = int32s(m["routed_experts"]).reshape(-1, 3, 3)  # every layer (the first dense: zeros) x top-3
    assert arr.shape[0] == len(PROMPTS[0]) + NEW - 1 - 3 and m["routed_experts_shape"] == list(arr.shape)
    assert (arr[:, 0] == 0).all() and (arr[:, 1:] == routes[0][3:].numpy()).all()
    ref = torch.log_softmax(hf_logits(hf_reference(ckpts["A"][0]), PROMPTS[0]), -1)
    got = m["input_token_logprobs"]
    assert [x[1] for x in got] == PROMPTS[0][2:] and len(m["input_top_logprobs"]) == len(got)
    assert max(abs(x[0] - float(ref[j + 1, PROMPTS[0][j + 2]])) for j, x in enumerate(got)) < TOL
    for body, needle in (({"routed_experts_start_len": 99, "return_routed_experts": True}, "exceeds"),
                         ({"return_logprob": True, "logprob_start_len": 19}, "start below 19"),
                         ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len")):
        r = client.post("/generate", headers=H, json={"input_ids": PROMPTS[0], **body})
        assert r.status_code == 400 and needle in r.text, r.text
    assert stats(client)["kv_pages_used"] == 0


def test_output_logprobs_are_never_null(client):
    """Abort mid-decode, a retract (recompute) and KV-pressure preemption: every generated token keeps a
    number (slime casts each one), aligned with output_ids; nothing leaks."""
    out: dict = {}

    def go(i: int) -> None:
        out[i] = gen(client, input_ids=PROMPTS[i % 2], return_logprob=True, top_logprobs_num=1,
                     sampling_params={"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True, "n": 2})
    p0 = stats(client)["num_preemptions"]
    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]  # 8 sequences > the 48-page pool
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while stats(client)["generation_tokens_total"] < 40:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.post("/pause_generation", headers=H, json={"mode": "retract"}).json()["success"]
    assert client.post("/continue_generation", headers=H, json={}).json()["success"]
    time.sleep(0.3)
    assert client.post("/abort_request", headers=H, json={"abort_all": True}).json()["success"]
    for t in threads:
        t.join(60)
    seen = 0
    for objs in out.values():
        for o in objs:
            lps = o["meta_info"]["output_token_logprobs"]
            assert [x[1] for x in lps] == o["output_ids"]
            assert all(isinstance(x[0], float) for x in lps)
            assert len(o["meta_info"]["output_top_logprobs"]) == len(lps)
            seen += len(lps)
    assert seen > 0 and stats(client)["num_preemptions"] > p0
    assert stats(client)["kv_pages_used"] == 0 and stats(client)["num_requests"] == 0


def _sender(ckpt: str, fmt: str, strategy: str) -> tuple[subprocess.Popen, dict]:
    """Another process holding the tensors in shared memory; it lives until its stdin closes."""
    proc = subprocess.Popen([sys.executable, str(SENDER), ckpt, fmt, strategy, "1", "print"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    return proc, json.loads(proc.stdout.readline())


def _done(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(60)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def _fp(obj) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_update_weights_from_tensor_across_processes(client, ckpts):
    (a, ra), (b, rb) = ckpts["A"], ckpts["B"]
    post = lambda body: client.post("/update_weights_from_tensor", headers=H, json=body)  # noqa: E731
    proc, body = _sender(b, "direct", "file_system")
    try:
        r = post({**body, "weight_version": "b"})
    finally:
        _done(proc)
    assert r.status_code == 200 and r.json()["success"], r.text
    o = gen(client, input_ids=PROMPTS, sampling_params=greedy(), return_logprob=True)
    assert [x["output_ids"] for x in o] == rb[0] and o[0]["meta_info"]["weight_version"] == "b"
    # torch's default strategy (file descriptors) reaches only processes with the sender's authkey
    proc, body = _sender(a, "direct", "file_descriptor")
    try:
        r = post(body)
    finally:
        _done(proc)
    assert r.status_code == 400 and "file_system" in r.json()["message"]
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    good = load_file(f"{a}/model.safetensors")
    bad = [({"serialized_named_tensors": ["%%%"]}, "not base64"),
           ({"serialized_named_tensors": []}, "empty"),
           ({"serialized_named_tensors": [base64.b64encode(pickle.dumps(_Evil())).decode()]}, "posix.system"),
           ({"serialized_named_tensors": [_fp([(name, good[name][:-1])])]}, "shape"),
           ({"serialized_named_tensors": [_fp([(name, good[name]), (name, good[name])])]}, "twice"),
           ({"serialized_named_tensors": [_fp({"flattened_tensor": good[name], "metadata": ["x"]})],
             "load_format": "flattened_bucket"}, "FlattenedTensorMetadata"),
           ({"serialized_named_tensors": [_fp([(name, good[name])])], "load_format": "gguf"}, "gguf")]
    for body, needle in bad:
        r = post(body)
        assert r.status_code == 400 and not r.json()["success"] and needle in r.json()["message"], r.text
    o = gen(client, input_ids=PROMPTS, sampling_params=greedy())
    assert [x["output_ids"] for x in o] == rb[0] and stats(client)["weight_version"] == "b"  # unchanged
    # the flattened bucket format, back to A (and a payload per rank, merged)
    proc, body = _sender(a, "flattened_bucket", "file_system")
    try:
        r = post({**body, "serialized_named_tensors": body["serialized_named_tensors"] * 2})
    finally:
        _done(proc)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert [x["output_ids"] for x in gen(client, input_ids=PROMPTS, sampling_params=greedy())] == ra[0]


def test_echo_on_a_tokenizer():
    """OpenAI echo with text: the prompt's text before the completion, its first token's logprob null."""
    from splash.engine.async_engine import AsyncEngine
    from splash.server.app import create_app

    eng = AsyncEngine.from_args(model="tiny", dtype="float32", num_kv_pages=32, device="cpu")
    with TestClient(create_app(eng)) as c:
        body = {"model": "tiny", "prompt": "hello world", "echo": True, "logprobs": 2, "temperature": 0}
        full = c.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]
        only = c.post("/v1/completions", json={**body, "max_tokens": 0}).json()["choices"][0]
        assert only["text"] == "hello world" and full["text"].startswith("hello world")
        n = len(only["logprobs"]["tokens"])
        assert only["logprobs"]["token_logprobs"][0] is None and only["logprobs"]["top_logprobs"][0] is None
        assert full["logprobs"]["token_logprobs"][:n] == only["logprobs"]["token_logprobs"]
        assert len(full["logprobs"]["tokens"]) == n + 3
        offs = full["logprobs"]["text_offset"]
        assert offs == sorted(offs) and offs[0] == 0
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0})
        assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
        chunks = c.post("/v1/completions", json={**body, "max_tokens": 2, "stream": True}).text
        first = json.loads(chunks.split("data: ")[1])["choices"][0]
        assert first["text"] == "hello world" and first["logprobs"]["token_logprobs"][0] is None


def test_engine_has_sglangs_shape(ckpts):
    """splash.Engine: generate / async_generate / stream with input_ids and a sampling_params dict, tensor
    updates in both formats, memory, pause, flush: the server's bodies; bad input raises ValueError."""
    import asyncio

    from splash import Engine

    (a, ra), (b, rb) = ckpts["A"], ckpts["B"]
    with Engine(model_path=a, enable_memory_saver=True, **ENGINE) as eng:
        one = eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(), return_logprob=True)
        assert one["output_ids"] == ra[0][0] and set(one) == {"text", "output_ids", "meta_info"}
        assert max(abs(x[0] - y) for x, y in zip(one["meta_info"]["output_token_logprobs"], ra[1][0])) < TOL
        many = eng.generate(input_ids=PROMPTS, sampling_params=greedy())
        assert [o["output_ids"] for o in many] == ra[0] and [o["index"] for o in many] == [0, 1]
        chunks = list(eng.generate(input_ids=PROMPTS[1], sampling_params=greedy(), stream=True))
        # cumulative objects, one per step the consumer kept up with (a busy machine may merge steps)
        lens = [len(c["output_ids"]) for c in chunks]
        assert lens == sorted(set(lens)) and lens[-1] == NEW and len(lens) > 1
        assert all(c["output_ids"] == chunks[-1]["output_ids"][:n] for c, n in zip(chunks, lens))
        assert chunks[-1]["output_ids"] == ra[0][1]

        async def both():
            return await asyncio.gather(*[eng.async_generate(input_ids=p, sampling_params=greedy())
                                          for p in PROMPTS])
        assert [o["output_ids"] for o in asyncio.run(both())] == ra[0]
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.generate(input_ids=[1, 500])
        with pytest.raises(ValueError, match="temprature"):
            eng.generate(input_ids=[1, 2], sampling_params={"temprature": 1.0})
        got = eng.update_weights_from_tensor(sorted(load_file(f"{b}/model.safetensors").items()),
                                             weight_version="b")
        assert got["success"] and got["weight_version"] == "b"
        assert [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=greedy())] == rb[0]
        name = "model.norm.weight"
        bad = eng.update_weights_from_tensor([(name, torch.zeros(3, dtype=torch.float64))])
        assert not bad["success"] and name in bad["message"]
        assert eng.pause_generation()["success"] and eng.flush_cache()["success"]
        assert eng.continue_generation()["success"]
        assert eng.release_memory_occupation()["success"]
        assert eng.resume_memory_occupation()["success"]
        assert eng.get_server_info()["enable_memory_saver"] is True and eng.get_weight_version() == "b"
        assert [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=greedy())] == rb[0]
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=PROMPTS[0])
