"""slime's request shapes against a 2-rank `splash serve --layout auto` (float64), written from reading slime
(rollout/sglang_rollout.py, utils/types.py, backends/sglang_utils/{sglang_engine,external,server_control}.py,
megatron_utils/update_weight/), not copied: what slime sends, and each check it makes of the answer.

- start-up (`--rollout-external`): server info by /server_info (falling back to /get_server_info), the
  key-by-key check of its launch options, the parallel config, the worker type, /health_generate;
- a rollout: per-sample /generate with slime's sampling params (top_p < 1 adds custom_params
  return_top_p_token_ids), return_logprob, return_routed_experts; each answer read as slime's Sample does
  (tokens and float logprobs from output_token_logprobs, top-p ids/offsets, routed experts of every layer);
- abort-all with partial outputs, then /v1/loads?include=core polled until idle;
- a colocated weight push mid-rollout: pause ({} = abort), flush_cache retried until 200 (a request that
  arrives meanwhile waits and does not block it), /update_weights_from_tensor from another process over
  shared memory, continue: greedy tokens and logprobs are transformers' of the new weights (1e-9);
- release/resume memory, the weight version, and prompt logprobs over HTTP (SGLang's logprob_start_len and
  lm-evaluation-harness's local-completions requests) against transformers at T=2.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers_ckpt import hf_logits, hf_reference
from rl_utils import two_checkpoints
from serve_utils import ServeProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [list(range(10, 29)), [90, 1, 33, 4, 8, 61, 17]]
NEW = 5
TOL = 1e-9
LAYERS, TOPK = 3, 3  # helpers_ckpt.BASE: 3 layers (the first dense), top-3 of 32 experts
SENDER = Path(__file__).with_name("tensor_sender.py")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return two_checkpoints(tmp_path_factory, PROMPTS, NEW)


@pytest.fixture(scope="module")
def server(ckpts):
    srv = ServeProcess(["--model", ckpts["A"][0], "--dtype", "float64", "--tp", "2", "--layout", "auto",
                        "--num-kv-pages", "512", "--max-num-seqs", "16", "--device", "cpu",
                        "--enable-memory-saver"])
    yield srv
    srv.close()


# ---- slime's client side, as it reads ------------------------------------------------------------------
def server_info(url: str) -> dict:
    for path in ("/server_info", "/get_server_info"):  # external.get_server_info's order
        r = httpx.get(url + path, timeout=30)
        if r.status_code == 200:
            return r.json()
    raise AssertionError("no server info")


def num_requests(load) -> int:
    """server_control.num_requests_from_load, re-read: a list sums, 'loads' recurses, a total wins."""
    if isinstance(load, list):
        return sum(num_requests(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    return int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))


def int32s(meta: dict, key: str) -> np.ndarray | None:
    v = meta.get(key)
    return None if v is None else np.frombuffer(base64.b64decode(v), dtype=np.int32)


def read_sample(prompt: list[int], out: dict) -> dict:
    """What Sample.append_response_tokens / _apply_meta_info take from one /generate answer (and check)."""
    meta = out["meta_info"]
    items = meta.get("output_token_logprobs", [])
    tokens = [x[1] for x in items]
    logprobs = [float(x[0]) for x in items]  # a null here would raise: slime casts every one
    assert tokens == out["output_ids"]
    sample = {"tokens": prompt + tokens, "logprobs": logprobs, "status": meta["finish_reason"]["type"],
              "version": meta.get("weight_version")}
    ids, offsets = int32s(meta, "top_p_token_ids"), int32s(meta, "top_p_token_offsets")
    if ids is not None or offsets is not None:
        assert ids is not None and offsets is not None and offsets[0] == 0 and offsets[-1] == len(ids)
        assert len(offsets) == len(tokens) + 1
        for j, t in enumerate(tokens):  # the draw came from its kept set
            assert t in ids[offsets[j]:offsets[j + 1]]
        sample["top_p"] = (ids, offsets)
    routed = int32s(meta, "routed_experts")
    if routed is not None:
        start = int(meta.get("routed_experts_start_len", 0) or 0)
        rows = len(sample["tokens"]) - 1 - start
        assert routed.size == rows * LAYERS * TOPK
        sample["routed"] = routed.reshape(rows, LAYERS, TOPK)
    return sample


SLIME_PARAMS = dict(temperature=1.0, top_p=0.9, top_k=-1, max_new_tokens=NEW, stop=None, stop_token_ids=None,
                    skip_special_tokens=True, no_stop_trim=True, spaces_between_special_tokens=False,
                    custom_params={"return_top_p_token_ids": True})


async def generate(client: httpx.AsyncClient, url: str, prompt: list[int], **sp) -> dict:
    payload = {"sampling_params": {**SLIME_PARAMS, **sp}, "return_logprob": True,
               "return_routed_experts": True, "input_ids": prompt}
    r = await client.post(url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return read_sample(prompt, r.json())


async def abort_until_idle(client: httpx.AsyncClient, url: str) -> int:
    """server_control.abort_server_until_idle: abort all, then poll the load, retrying the abort."""
    for attempt in range(1, 50):
        await client.post(url + "/abort_request", json={"abort_all": True})
        load = (await client.get(url + "/v1/loads?include=core")).json()
        if num_requests(load) <= 0:
            return attempt
        await asyncio.sleep(0.2)
    raise AssertionError("the server never became idle")


def flush_with_retry(url: str, tries: int = 60) -> int:
    """SGLangEngine.flush_cache: GET until 200 (it is refused while requests hold KV)."""
    for i in range(tries):
        if httpx.get(url + "/flush_cache", timeout=30).status_code == 200:
            return i
        time.sleep(0.1)
    raise AssertionError("flush_cache never succeeded")


def push_tensors(url: str, ckpt: str, fmt: str, version: str) -> dict:
    """The colocated trainer: another process posts its tensors by shared-memory handle (one per rank)."""
    # (output to a file: torch's shared-memory manager, a child of the sender, keeps inherited pipes open)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, str(SENDER), ckpt, fmt, "file_system", "2", "post", url,
                                 version], stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.wait(120) == 0, (log.seek(0), log.read()[-2000:])[1]
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        return json.loads(log.read().strip().splitlines()[-1])


# ---- the test --------------------------------------------------------------------------------------------
def test_slime_rollout_abort_and_colocated_update(server, ckpts):
    url = server.url
    info = server_info(url)
    # --rollout-external's check with --colocate (offload_rollout on) and routing replay on
    expect = {"enable_memory_saver": True, "enable_return_routed_experts": True}
    assert {k: info.get(k) for k in expect} == expect
    assert int(info.get("tp_size") or 1) == 2 and int(info.get("pp_size") or 1) == 1
    assert info.get("disaggregation_mode") in (None, "null") and not info.get("encoder_only")
    assert info["dtype"] == "float64" and info["layout_mode"] == "auto"
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    (a, ra), (b, rb) = ckpts["A"], ckpts["B"]

    async def phases() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            # a rollout: groups of 4 samples per prompt, each its own request (generate_and_rm_group)
            group = [generate(c, url, p) for p in PROMPTS for _ in range(4)]
            for s in await asyncio.gather(*group):
                assert s["status"] in ("length", "stop") and len(s["logprobs"]) <= NEW
                assert s["routed"][:, 0].max() == 0  # the dense first layer reports zeros, as SGLang
            greedy = await asyncio.gather(*[generate(c, url, p, temperature=0.0) for p in PROMPTS])
            for s, toks, lps, routes in zip(greedy, *ra):
                assert s["tokens"][-NEW:] == toks and np.allclose(s["logprobs"], lps, atol=TOL, rtol=0)
                assert (s["routed"][:, 1:] == routes.numpy()).all()

            # abort-all with partial outputs while long requests run
            long = [asyncio.create_task(generate(c, url, p, max_new_tokens=300, ignore_eos=True))
                    for p in PROMPTS * 2]
            deadline = time.monotonic() + 60
            while (await c.get(url + "/get_server_info")).json()["generation_tokens_total"] < 40:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await abort_until_idle(c, url)
            parts = await asyncio.gather(*long)
            assert all(s["status"] == "abort" for s in parts)
            assert any(0 < len(s["logprobs"]) < 300 for s in parts)
            assert (await c.get(url + "/v1/loads?include=core")).json()["loads"][0]["num_total_reqs"] == 0

            # a weight push mid-rollout (UpdateWeightFromTensor.update_weights)
            running = [asyncio.create_task(generate(c, url, p, max_new_tokens=300, ignore_eos=True))
                       for p in PROMPTS]
            while (await c.get(url + "/v1/loads?include=core")).json()["loads"][0]["num_running_reqs"] < 2:
                await asyncio.sleep(0.05)
            r = await c.get(url + "/flush_cache")
            assert r.status_code == 400 and "hold KV" in r.json()["message"]  # what slime's retry sees
            assert (await c.post(url + "/pause_generation", json={})).json()["success"]
            late = asyncio.create_task(generate(c, url, PROMPTS[0], temperature=0.0))  # waits out the pause
            await asyncio.sleep(0.3)
            tries = await asyncio.to_thread(flush_with_retry, url)
            assert tries == 0  # the waiting request holds no KV: nothing to retry for
            got = await asyncio.to_thread(push_tensors, url, b, "flattened_bucket", "1")
            assert got["status"] == 200 and got["body"]["success"], got
            assert (await c.post(url + "/continue_generation", json={})).json()["success"]
            for s in await asyncio.gather(*running):
                assert s["status"] == "abort"
            s = await late
            assert s["tokens"][-NEW:] == rb[0][0] and s["version"] == "1"
            assert np.allclose(s["logprobs"], rb[1][0], atol=TOL, rtol=0)
            assert (await c.get(url + "/get_weight_version")).json()["weight_version"] == "1"
            # the same push in the direct format, back to A
            got = await asyncio.to_thread(push_tensors, url, a, "direct", "2")
            assert got["status"] == 200 and got["body"]["success"], got
            s = await generate(c, url, PROMPTS[1], temperature=0.0)
            assert s["tokens"][-NEW:] == ra[0][1] and s["version"] == "2"

            # colocated offload between rollouts
            assert (await c.post(url + "/release_memory_occupation", json={})).json()["success"]
            for tags in (["weights"], ["kv_cache"]):
                r = await c.post(url + "/resume_memory_occupation", json={"tags": tags})
                assert r.json()["success"]
            s = await generate(c, url, PROMPTS[1], temperature=0.0)
            assert s["tokens"][-NEW:] == ra[0][1]

    asyncio.run(phases())
    st = httpx.get(url + "/get_server_info", timeout=30).json()
    assert st["kv_pages_used"] == 0 and st["num_requests"] == 0


def test_prompt_logprobs_over_http_match_transformers(server, ckpts):
    """SGLang's input_token_logprobs and lm-eval's local-completions requests at T=2 (weights A again)."""
    url, (a, _) = server.url, ckpts["A"]
    hf = hf_reference(a)
    ref = [torch.log_softmax(hf_logits(hf, p), -1) for p in PROMPTS]
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": PROMPTS, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    for o, p, lp in zip(r.json(), PROMPTS, ref):
        got = o["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in got] == p and got[0][0] is None
        assert max(abs(x[0] - float(lp[j - 1, p[j]])) for j, x in enumerate(got) if j) < TOL
        tops = o["meta_info"]["input_top_logprobs"]
        assert tops[0] is None and [t[1] for t in tops[1]] == lp[0].topk(2).indices.tolist()
    # lm-eval loglikelihood: context + continuation as token ids, echo, logprobs 1, max_tokens 1
    ctx = 4
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": a, "prompt": PROMPTS, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
        "seed": 1234})
    assert r.status_code == 200, r.text
    for ch, p, lp in zip(r.json()["choices"], PROMPTS, ref):
        tl, top = ch["logprobs"]["token_logprobs"], ch["logprobs"]["top_logprobs"]
        assert len(tl) == len(p) + 1 and tl[0] is None and top[0] is None
        want = sum(float(lp[j - 1, p[j]]) for j in range(ctx, len(p)))
        assert abs(sum(tl[ctx:-1]) - want) < TOL
        greedy = all(t == max(d.values()) for t, d in zip(tl[ctx:-1], top[ctx:-1]))
        assert greedy == all(int(lp[j - 1].argmax()) == p[j] for j in range(ctx, len(p)))
    # max_tokens 0: the prompt alone; generate_until: stop strings and max_tokens as lm-eval sends them
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": a, "prompt": PROMPTS[1], "max_tokens": 0, "logprobs": 0, "echo": True})
    ch = r.json()["choices"][0]
    assert len(ch["logprobs"]["token_logprobs"]) == len(PROMPTS[1])
    assert r.json()["usage"]["completion_tokens"] == 0
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": a, "prompt": [PROMPTS[0]], "max_tokens": NEW, "temperature": 0, "stop": ["\n\n"],
        "seed": 1234})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
