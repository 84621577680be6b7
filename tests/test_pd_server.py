"""Prefill/decode disaggregation, the server's side: SGLang's flags and request fields, the prefill's room
table and bootstrap server, the decode's half, and 1P1D behind sglang-router 0.3.2 in PD mode.

End to end: a prefill and a decode `splash serve --model tiny --dtype float64` and
`python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP --decode URL`; greedy
tokens through the router equal a colocated server's (tiny; tiny-dsa's and tiny-glm5's indexer keys,
tiny-hybrid's KDA state, an FP8 cache, MTP too); the prefill killed -> the decode answers an error
(bounded by its heartbeat) and its books balance (no request, no page held); a dead decode or a refused
request fails that request only. Every server runs with --check-books (the books proved after each step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import re
import signal
import sys
import tempfile
import time

import httpx
import pytest
from serve_utils import LoopbackProcess, ServeProcess, free_port

from splash.cli import build_parser
from splash.commands.serve import engine_config
from splash.config import EngineConfig
from splash.core.model_config import ConfigError
from splash.server.errors import APIError
from splash.server.native_protocol import GenerateRequest
from splash.server.pd import Bootstrap, DecodeSide, bootstraps
from splash.server.pd_rooms import PrefillRooms, bootstrap_app
from splash.server.protocol import ChatCompletionRequest, CompletionRequest


def serve_config(*argv: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["serve", "--model", "m", *argv]))


# ---- flags ---------------------------------------------------------------------------------------------
def test_sglang_disaggregation_flags_parse_into_engine_config():
    c = serve_config("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001",
                     "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", "mlx5_0")
    assert (c.disaggregation_mode, c.disaggregation_bootstrap_port, c.disaggregation_ib_device) == \
        ("prefill", 9001, "mlx5_0")
    c = serve_config("--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache",
                     "--num-reserved-decode-tokens", "64")
    assert (c.disaggregation_mode, c.disaggregation_decode_enable_radix_cache,
            c.num_reserved_decode_tokens) == ("decode", True, 64)
    c = serve_config()
    assert (c.disaggregation_mode, c.disaggregation_transfer_backend, c.disaggregation_bootstrap_port) == \
        ("null", "mooncake", 8998)
    assert EngineConfig.from_kwargs(disaggregation_mode="decode").disaggregation_mode == "decode"
    # a decode server's prefix cache: off unless asked for (SGLang's default)
    assert serve_config("--disaggregation-mode", "decode").enable_prefix_caching is False
    assert serve_config("--disaggregation-mode", "decode",
                        "--disaggregation-decode-enable-radix-cache").enable_prefix_caching is True
    assert serve_config("--disaggregation-mode", "decode", "--enable-prefix-caching").enable_prefix_caching
    assert serve_config("--disaggregation-mode", "prefill").enable_prefix_caching is None


@pytest.mark.parametrize("argv, msg", [
    (["--disaggregation-transfer-backend", "nixl"], r"nixl: NVIDIA's NIXL .* use mooncake"),
    (["--disaggregation-transfer-backend", "fake"], r"fake: SGLang's fake backend moves no KV"),
    (["--disaggregation-transfer-backend", "ascend"], r"ascend: .* use mooncake"),
    (["--disaggregation-mode", "decode", "--tp", "2", "--nnodes", "2"], r"a PD side spans one node"),
])
def test_what_is_not_built_is_refused_by_name(argv, msg):
    with pytest.raises(ConfigError, match=msg):
        serve_config(*argv)
    with pytest.raises(SystemExit):  # (argparse: the mode's choices)
        serve_config("--disaggregation-mode", "both")


# ---- request fields ------------------------------------------------------------------------------------
def test_bootstrap_fields_are_accepted_on_every_generation_route():
    g = GenerateRequest(input_ids=[[1, 2], [3]], bootstrap_host=["h", "h"], bootstrap_port=[8998, 8998],
                        bootstrap_room=[5, 2**63 + 7])
    assert bootstraps(g, 2) == [Bootstrap("h", 8998, 5), Bootstrap("h", 8998, 2**63 + 7)]
    c = CompletionRequest(prompt="hi", bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=3)
    assert bootstraps(c, 1) == [Bootstrap("127.0.0.1", 1, 3)]
    m = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], bootstrap_host="h",
                              bootstrap_port=None, bootstrap_room=4)
    assert bootstraps(m, 1) == [Bootstrap("h", None, 4)]
    assert bootstraps(GenerateRequest(input_ids=[1]), 1) is None
    with pytest.raises(APIError, match="one room per prompt"):
        bootstraps(GenerateRequest(input_ids=[[1], [2]], bootstrap_host="h", bootstrap_room=1), 2)
    with pytest.raises(APIError, match="lists 1 entries for 2 prompts"):
        bootstraps(GenerateRequest(input_ids=[[1], [2]], bootstrap_room=[1]), 2)


# ---- the prefill's rooms (a fake engine) ---------------------------------------------------------------
class FakeEngine:
    """The AsyncEngine PD methods the server calls, answering at once."""

    def __init__(self, error: str | None = None, mismatch: str | None = None) -> None:
        self.error, self.mismatch = error, mismatch
        self.prefilled: list[tuple[str, dict]] = []
        self.failed: list[tuple[str, str]] = []

    async def pd_prefill(self, rid, prompt, params, dest):
        self.prefilled.append((rid, dest))
        return f"out-{rid}", {"first_token": 7, "logprobs": {7: -0.5, 3: -math.inf}, "error": self.error,
                              "bytes": 1024, "seconds": 0.001}

    async def pd_check_peer(self, info):
        if self.mismatch:
            raise ValueError(self.mismatch)

    async def pd_layout_info(self):
        return {"session_id": "127.0.0.1:4242", "page_size": 16}


class P:
    n = 1


def _dest(pages: list[int]) -> dict:
    return {"pages": pages, "session_id": "127.0.0.1:1", "layout": {"session_id": "127.0.0.1:1"}}


async def _collect(agen):
    return [x async for x in agen]


def test_a_room_pairs_one_request_with_one_destination_in_either_order():
    async def go():
        rooms = PrefillRooms(FakeEngine())
        # the request first, then the destination
        task = asyncio.create_task(_collect(rooms.generate([1, 2], P(), "r1", 11)))
        await asyncio.sleep(0.01)
        assert rooms.stats()["pd_rooms_bootstrapping"] == 1
        await rooms.put_dest(11, _dest([0]))
        assert await task == ["out-r1-pd11"]  # (its own engine id)
        st = await rooms.poll(11, 0.0)
        assert st["status"] == "done" and st["first_token"] == 7 and st["bytes"] == 1024
        assert {t: float.fromhex(v) for t, v in st["logprobs"]} == {7: -0.5, 3: -math.inf}  # exact, -inf kept
        # the destination first (the router posts to both at once)
        await rooms.put_dest(12, _dest([1]))
        assert await _collect(rooms.generate([3], P(), "r2", 12)) == ["out-r2-pd12"]
        # a room is one request: a second one is refused, so is a second destination
        with pytest.raises(APIError, match="already in use") as e:
            await _collect(rooms.generate([3], P(), "r3", 12))
        assert e.value.code == "duplicate_bootstrap_room"
        with pytest.raises(APIError, match="already has a destination") as e:
            await rooms.put_dest(11, _dest([2]))
        assert e.value.status == 409

    asyncio.run(go())


def test_bootstrap_timeout_transfer_error_and_handshake_fail_that_request_only():
    async def go():
        rooms = PrefillRooms(FakeEngine(), bootstrap_timeout_s=0.05)
        with pytest.raises(APIError, match="bootstrap timeout") as e:
            await _collect(rooms.generate([1], P(), "r1", 1))
        assert e.value.status == 504
        assert (await rooms.poll(1, 0))["status"] == "failed"
        bad = PrefillRooms(FakeEngine(error="peer 127.0.0.1:1 refused"))
        await bad.put_dest(2, _dest([0]))
        with pytest.raises(APIError, match="KV transfer to the decode failed: peer") as e:
            await _collect(bad.generate([1], P(), "r2", 2))
        st = await bad.poll(2, 5.0)  # (ended: no wait)
        assert st["status"] == "failed" and "KV transfer failed" in st["error"]
        odd = PrefillRooms(FakeEngine(mismatch="dtype: prefill float64, decode float32"))
        with pytest.raises(APIError, match="disagree: dtype: prefill float64, decode float32"):
            await odd.put_dest(3, _dest([0]))
        with pytest.raises(APIError, match="unknown here") as e:
            await rooms.poll(99, 0)
        assert e.value.status == 404
        # the room table keeps serving the next room
        await rooms.put_dest(4, _dest([0]))
        assert await _collect(rooms.generate([1], P(), "r4", 4)) == ["out-r4-pd4"]

    asyncio.run(go())


def test_bootstrap_server_routes():
    from fastapi.testclient import TestClient

    rooms = PrefillRooms(FakeEngine())
    c = TestClient(bootstrap_app(rooms, 16))
    assert c.get("/health").text == "OK"
    assert c.get("/route").json() == {"prefill_attn_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1,
                                      "prefill_page_size": 16}
    r = c.get("/route", params={"engine_rank": 0, "target_dp_group": 0}).json()
    assert (r["rank_ip"], r["rank_port"]) == ("127.0.0.1", 4242)
    assert c.put("/route", json={"role": "Prefill", "rank_ip": "x", "rank_port": 1}).text == "OK"
    assert c.post("/pd/rooms/5", json={"dest": _dest([0])}).json()["accepted"] is True
    assert c.get("/pd/rooms/5").json()["status"] == "waiting_for_input"
    assert c.post("/pd/rooms/5", json={"dest": _dest([0])}).status_code == 409
    own = {"pages": [0], "session_id": "127.0.0.1:4242", "layout": {"session_id": "127.0.0.1:4242"}}
    assert c.post("/pd/rooms/7", json={"dest": own}).status_code == 400  # (the prefill's own memory)
    own = {"pages": [0], "session_id": "127.0.0.1:1",  # (... named by one of its ranks)
           "layout": {"session_id": "127.0.0.1:1", "ranks": [{"session_id": "127.0.0.1:4242"}]}}
    assert c.post("/pd/rooms/8", json={"dest": own}).status_code == 400
    assert c.post("/pd/rooms/6", json={}).status_code == 400
    assert c.delete("/pd/rooms/5").json()["status"] == "failed"
    assert c.get("/pd/rooms/5").json()["status"] == "failed"


class FakeDecodeEngine:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []
        self.reserved: list[str] = []

    async def pd_reserve(self, rid, prompt, params, timeout_s=30.0):
        self.reserved.append(rid)
        return {"request_id": rid, "pages": [0], "layout": {}}

    async def pd_fail(self, rid, reason):
        self.failed.append((rid, reason))

    async def pd_stream(self, rid):
        for rid_, why in self.failed:
            if rid_ == rid:
                raise RuntimeError(why)
        yield None  # pragma: no cover


def test_decode_fails_clearly_when_the_prefill_is_unreachable():
    async def go():
        eng = FakeDecodeEngine()
        side = DecodeSide(eng)
        t0 = time.monotonic()
        with pytest.raises(APIError, match=r"bootstrap server at 127.0.0.1:\d+ is unreachable") as e:
            await _collect(side.generate([1, 2], P(), "d1", Bootstrap("127.0.0.1", free_port(), 9)))
        assert e.value.status == 502 and time.monotonic() - t0 < 10
        assert eng.failed and eng.failed[0][0] == "d1"  # its pages freed
        with pytest.raises(APIError, match="needs bootstrap_host and bootstrap_port"):
            await _collect(side.generate([1], P(), "d2", Bootstrap("127.0.0.1", None, 9)))

    asyncio.run(go())


def test_a_decode_released_between_the_write_and_the_arrival_fails_the_request_not_hangs(one_torch_thread):
    """The prefill wrote the KV (its room done), then the decode's KV memory was released before the
    decode took it in: the release failed the waiting request, so its stream would never speak (a soak
    through the router saw such requests hang until the client's read timeout). Real engines on two
    threads, the room's answer played by the prefill engine itself; the request fails at once, 502, and
    nothing stays held on the decode."""
    if not _mooncake_ok():
        pytest.skip("the Mooncake transfer engine does not import: run `make setup`")
    from splash.engine.async_engine import AsyncEngine
    from splash.engine.build import build_engine
    from splash.engine.sampling import SamplingParams

    kw = dict(dtype="float64", page_size=4, max_num_seqs=4, device="cpu", check_books=True, num_kv_pages=32)
    pre = AsyncEngine.built_on_thread(lambda: build_engine("tiny", **kw))
    dec = AsyncEngine.built_on_thread(lambda: build_engine("tiny", **kw, enable_memory_saver=True))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = list(range(10, 31))

    async def meet(boot, dest):  # (the room: the prefill writes, then the decode releases its KV memory)
        _, res = await pre.pd_prefill("r", ids, params, dest)
        assert res["error"] is None and res["bytes"] > 0
        await dec.call(lambda eng: eng.release_memory_occupation(["kv_cache"]))
        return {"status": "done", "first_tokens": [res["first_token"]], "first_logprobs": [None]}

    async def go():
        side = DecodeSide(dec)
        side._meet = meet
        t0 = time.monotonic()
        with pytest.raises(APIError, match="dropped request r before its transferred KV") as e:
            await asyncio.wait_for(_collect(side.generate(ids, params, "r", Bootstrap("127.0.0.1",
                                                                                       free_port(), 5))), 60)
        assert e.value.status == 502 and time.monotonic() - t0 < 30
        await dec.call(lambda eng: eng.resume_memory_occupation(["kv_cache"]))
        out = [o async for o in dec.generate(ids, params, "after")]  # (the decode keeps serving)
        assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 4

        def held(eng):
            eng.rl.flush_cache()  # (the prefix cache's pages count as used)
            return len(eng.requests), eng.stats()["kv_pages_used"], eng.scheduler.book_errors()

        for eng in (pre, dec):
            n, used, errors = await eng.call(held)
            assert (n, used) == (0, 0) and not errors, (n, used, errors)

    try:
        asyncio.run(go())
    finally:
        pre.shutdown()
        dec.shutdown()


# ---- end to end: 1P1D behind sglang-router in PD mode ---------------------------------------------------
SERVE = ["--model", "tiny", "--dtype", "float64", "--max-model-len", "256", "--num-kv-pages", "64",
         "--max-num-seqs", "4", "--check-books"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _mooncake_ok() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401 - needs libibverbs.so.1 (make setup)
    except Exception:  # noqa: BLE001 - not installed, or its library missing
        return False
    return True


class PDRouter(LoopbackProcess):
    """sglang-router 0.3.2 in PD mode on a free loopback port, in front of `prefills` ((URL, bootstrap
    port) each) and `decodes` (URLs); ready once every server is healthy."""

    name = "sglang-router-pd"

    def __init__(self, prefills: list[tuple[str, int]], decodes: list[str], *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = len(prefills) + len(decodes)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               *(a for url, boot in prefills for a in ("--prefill", url, str(boot))),
               *(a for url in decodes for a in ("--decode", url)), "--host", "127.0.0.1",
               "--port", str(self.port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
               str(free_port()), "--shutdown-grace-period-secs", "1", "--log-level", "info", *extra]
        # its tokenizer lookup of model path "tiny" goes to the hub: a closed loopback port fails it at once
        env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1",
               "HF_HOME": tempfile.mkdtemp(prefix="sglang-router-hf-")}
        super().__init__(cmd, env, 60.0)

    def ready(self) -> bool:
        r = httpx.get(self.url + "/readiness", timeout=2.0)
        return r.status_code == 200 and r.json().get("healthy_workers") == self.workers

    def output(self) -> str:
        return ANSI.sub("", super().output())

    def close(self) -> None:
        self.stop(timeout=15)


def _one_p_one_d(model: str, *extra: str):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (dev extras)")
    if not _mooncake_ok():
        pytest.skip("the Mooncake transfer engine does not import: run `make setup` (it installs "
                    "mooncake-transfer-engine-non-cuda and Debian's libibverbs1)")
    args = [*SERVE[:1], model, *SERVE[2:], *extra]
    boot = free_port()
    procs = []
    try:
        procs.append(ServeProcess([*args, "--disaggregation-mode", "prefill",
                                   "--disaggregation-bootstrap-port", str(boot)]))
        procs.append(ServeProcess([*args, "--disaggregation-mode", "decode"]))
        procs.append(PDRouter([(procs[0].url, boot)], [procs[1].url]))
        yield procs[0], procs[1], procs[2], boot
    finally:
        for p in reversed(procs):
            p.close()


@pytest.fixture(scope="module")
def pd():
    yield from _one_p_one_d("tiny")


@pytest.fixture(params=["tiny-dsa", "tiny-glm5", "tiny-hybrid", "tiny-fp8", "tiny-mtp"])
def pd_family(request, tmp_path_factory):
    if request.param == "tiny-mtp":  # (an MTP layer: its draft KV and first chain cross too)
        import dataclasses

        from splash.core.presets import PRESETS
        from splash.model.tiny import write_tiny_model

        path = write_tiny_model(tmp_path_factory.mktemp("pd-mtp") / "tiny-mtp", seed=3,
                                cfg=dataclasses.replace(PRESETS["tiny"], num_nextn_predict_layers=1))
        args = [str(path), "--speculative-algorithm", "MTP", "--speculative-policy", "always"]
    else:
        args = ["tiny", "--kv-cache-dtype", "fp8_ds_mla"] if request.param == "tiny-fp8" else [request.param]
    yield from _one_p_one_d(*args)


def _post(url: str, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def _loads(url: str) -> dict:
    return httpx.get(url + "/v1/loads", params={"include": "memory"}, timeout=10).json()["loads"][0]


def _info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


IDS = [[5, 17, 99, 3, 42, 7, 8, 250, 31, 64, 2, 19, 77, 101, 13, 6, 44, 91, 120, 9],  # > 1 page
       [11, 12, 13]]


def _pd_direct(prefill: ServeProcess, decode: ServeProcess, boot: int, body: dict) -> dict:
    """The two halves posted at once, as sglang-router does; the decode's answer."""
    room = int.from_bytes(os.urandom(7), "big")
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        p = ex.submit(_post, prefill.url, "/generate", body)
        d = ex.submit(_post, decode.url, "/generate", body)
        assert p.result().status_code == 200, p.result().text
        assert d.result().status_code == 200, d.result().text
        return d.result().json()


def test_router_in_pd_mode_answers_as_a_colocated_server(pd):
    prefill, decode, router, boot = pd
    for s, mode in ((prefill, "prefill"), (decode, "decode")):
        assert httpx.get(s.url + "/server_info", timeout=10).json()["disaggregation_mode"] == mode
    for ids in IDS:
        body = {"input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
        # the reference: the same checkpoint answering the request whole (no bootstrap fields: colocated)
        ref = _post(decode.url, "/generate", body).json()
        got = _post(router.url, "/generate", body)
        assert got.status_code == 200, (got.text, router.output()[-2000:])
        got = got.json()
        assert got["output_ids"] == ref["output_ids"] and len(ref["output_ids"]) == 8
        # float64 logprobs, the first token's from the prefill, the rest from the decode: exact when the
        # two halves are posted as the router does (the router's own JSON float parsing may move a
        # value by an ulp, so through it they are equal to 1e-12)
        lp = [x[0] for x in ref["meta_info"]["output_token_logprobs"]]
        assert [x[0] for x in got["meta_info"]["output_token_logprobs"]] == pytest.approx(lp, abs=1e-12)
        direct = _pd_direct(prefill, decode, boot, body)
        assert direct["output_ids"] == ref["output_ids"]
        assert direct["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]
    # the prompt's logprobs (computed by the prefill, answered by the decode), exact
    body = {"input_ids": IDS[0], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}}
    ref = _post(decode.url, "/generate", body).json()["meta_info"]
    got = _pd_direct(prefill, decode, boot, body)["meta_info"]
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert got[key] == ref[key], key
    # /v1/completions with a string prompt (the router refuses token-id prompts there), whole and streamed
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    ref = _post(decode.url, "/v1/completions", body).json()["choices"][0]["text"]
    got = _post(router.url, "/v1/completions", body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == ref
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    assert "".join(c["text"] for x in chunks[:-1] for c in json.loads(x)["choices"]) == ref
    # SGLang's streamed /generate: cumulative objects, the last one with every token
    body = {"input_ids": IDS[0], "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    ref = _post(decode.url, "/generate", {**body, "stream": False}).json()["output_ids"]
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["output_ids"] == ref
    # a batch (the router sends a room per prompt) and a chat completion
    body = {"input_ids": IDS,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    ref = [o["output_ids"] for o in _post(decode.url, "/generate", body).json()]
    got = _post(router.url, "/generate", body)
    assert got.status_code == 200, got.text
    assert [o["output_ids"] for o in got.json()] == ref
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5,
            "temperature": 0.0}
    ref = _post(decode.url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    got = _post(router.url, "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == ref["content"]
    # concurrent requests (more than --max-num-seqs): each pairs with its own room
    bodies = [{"input_ids": [(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)],
               "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
              for i in range(8)]
    refs = [_post(decode.url, "/generate", b).json()["output_ids"] for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda b: _post(router.url, "/generate", b), bodies))
    assert [r.status_code for r in outs] == [200] * 8, [r.text for r in outs if r.status_code != 200]
    assert [r.json()["output_ids"] for r in outs] == refs
    # a request the prefill refuses (here: a budget over its context) fails its room at once, so the
    # decode waiting on it answers now, not after a timeout
    bad = {"input_ids": IDS[1], "sampling_params": {"max_new_tokens": 1000}, "bootstrap_host": "127.0.0.1",
           "bootstrap_port": boot, "bootstrap_room": 4242}
    assert _post(prefill.url, "/generate", bad).status_code == 400
    t0 = time.monotonic()
    r = _post(decode.url, "/generate", {**bad, "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 502 and "the prefill refused the request" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 5
    # the transfers were counted on both sides, and nothing is held after them
    assert _counter(prefill.url, "splash:kv_transfer_bytes_total") > 0
    assert _counter(decode.url, "splash:kv_transfer_bytes_total") > 0
    for s in (prefill, decode):
        load = _loads(s.url)
        assert (load["num_total_reqs"], load["num_used_tokens"]) == (0, 0), load


def test_every_store_moves_through_the_router(pd_family):
    """DeepSeek-V3.2's and GLM-5's indexer keys (tiny-dsa, tiny-glm5: its shared layers carry none), a
    Kimi-Linear hybrid's KDA state (tiny-hybrid) and an FP8 cache's bytes (tiny-fp8: `--kv-cache-dtype
    fp8_ds_mla` on both); with an MTP layer (tiny-mtp) the prompt's draft KV and the prefill's first
    chain, so the verify steps equal a colocated server's. Tokens and float64 logprobs as colocated."""
    prefill, decode, router, _ = pd_family
    body = {"input_ids": IDS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    ref = _post(decode.url, "/generate", body).json()
    got = _post(router.url, "/generate", body)
    assert got.status_code == 200, got.text
    assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in ref]
    for g, r in zip(got.json(), ref):  # (float64 logprobs: the router may move one by an ulp)
        lp = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        assert [x[0] for x in g["meta_info"]["output_token_logprobs"]] == pytest.approx(lp, abs=1e-12)
    verifies = [o["meta_info"].get("spec_verify_ct") for o in got.json()]
    assert verifies == [o["meta_info"].get("spec_verify_ct") for o in ref]
    assert all(verifies) == (_info(decode.url).get("speculative_algorithm") == "MTP")
    assert _counter(decode.url, "splash:kv_transfer_bytes_total") > 0
    for s in (prefill, decode):
        load = _loads(s.url)
        assert (load["num_total_reqs"], load["num_used_tokens"]) == (0, 0), load


def test_a_transfer_to_a_dead_decode_fails_that_request_only(pd):
    prefill, _, _, boot = pd
    layout = httpx.get(f"http://127.0.0.1:{boot}/route", params={"engine_rank": 0, "target_dp_group": 0},
                       timeout=10).json()["layout"]
    # a destination whose decode is gone (nothing listens on its session's port): the write fails at once
    gone = f"127.0.0.1:{free_port()}"
    ranks = [{**r, "session_id": gone} for r in layout.get("ranks", ())]  # (each rank's own session)
    dest = {"request_id": "gone", "session_id": gone, "pages": [0, 1], "slot": -1,
            "num_tokens": len(IDS[0]), "layout": {**layout, "session_id": gone, "ranks": ranks}}
    # (a destination in the prefill's own memory is refused)
    mine = {**dest, "session_id": layout["session_id"], "layout": layout}
    r = httpx.post(f"http://127.0.0.1:{boot}/pd/rooms/31336", json={"dest": mine}, timeout=10)
    assert r.status_code == 400 and "this prefill's own" in r.text, r.text
    r = httpx.post(f"http://127.0.0.1:{boot}/pd/rooms/31337", json={"dest": dest}, timeout=10)
    assert r.status_code == 200, r.text
    body = {"input_ids": IDS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 31337}
    failures = _counter(prefill.url, "splash:kv_transfer_failures_total")
    r = _post(prefill.url, "/generate", body, timeout=30)
    assert r.status_code == 502 and "KV transfer to the decode failed" in r.json()["error"]["message"], r.text
    room = httpx.get(f"http://127.0.0.1:{boot}/pd/rooms/31337", timeout=10).json()
    assert room["status"] == "failed" and "KV transfer failed" in room["error"]
    assert _counter(prefill.url, "splash:kv_transfer_failures_total") == failures + 1
    load = _loads(prefill.url)
    assert (load["num_total_reqs"], load["num_used_tokens"]) == (0, 0), load
    ok = _post(prefill.url, "/generate", {k: v for k, v in body.items() if not k.startswith("bootstrap")})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4  # (the server keeps serving)


def test_a_dead_prefill_makes_the_decode_answer_an_error_not_hang(pd):
    prefill, decode, router, boot = pd
    body = {"input_ids": IDS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 12345}
    # the decode has posted its destination and polls the room (its prefill half never came) when the
    # prefill dies: its heartbeat ends the request
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        waiting = ex.submit(_post, decode.url, "/generate", {**body, "bootstrap_room": 777}, 30)
        deadline = time.monotonic() + 10
        while _info(decode.url)["pd_waiting_for_kv"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _info(decode.url)["pd_waiting_for_kv"] == 1 and _loads(decode.url)["num_used_tokens"] > 0
        time.sleep(0.3)
        prefill.stop(signal.SIGKILL, timeout=10)
        t0 = time.monotonic()
        r = waiting.result()
    assert r.status_code == 502 and "lost the prefill" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    r = _post(decode.url, "/generate", body, timeout=30)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 15
    r = _post(router.url, "/generate", {k: v for k, v in body.items() if not k.startswith("bootstrap")},
              timeout=30)
    assert r.status_code >= 400  # (the router: its prefill is gone)
    # the decode's books balance and it keeps serving
    deadline = time.monotonic() + 10
    while (load := _loads(decode.url))["num_total_reqs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (load["num_total_reqs"], load["num_used_tokens"]) == (0, 0), load
    assert _info(decode.url)["pd_waiting_for_kv"] == 0
    ok = _post(decode.url, "/generate", {k: v for k, v in body.items() if not k.startswith("bootstrap")})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
