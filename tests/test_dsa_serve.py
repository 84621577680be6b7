"""Live DSA servers (sparse at these prompt lengths) driven by the official `openai` client and SGLang's
native `/generate`: `--model tiny-dsa --tp 2 --layout auto`, and `--model tiny-glm5 --tp 2` (shared
indexer layers) with forced live switches, each against its single-rank server's greedy tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import ServeProcess

from splash.core.presets import PRESETS
from splash.core.stores import token_stores

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
PROMPT = list(range(40, 90))  # 50 tokens: past tiny-dsa's index_topk of 16


@pytest.fixture(scope="module")
def servers():
    common = ["--dtype", "float64", "--max-num-seqs", "4", "--num-kv-pages", "64"]
    specs = [["--model", "tiny-dsa", *common],
             ["--model", "tiny-dsa", "--tp", "2", *common, "--layout", "auto"],
             ["--model", "tiny-glm5", *common],
             ["--model", "tiny-glm5", "--tp", "2", *common, "--layout", "dp",
              "--switch-schedule", "2:cp,4:dop,6:tp,8:dp"]]
    started: list[ServeProcess] = []
    try:
        for args in specs:
            started.append(ServeProcess(args))
        yield tuple(started)
    finally:
        for srv in started:
            srv.close()


def _generate(url: str, ids: list[int], n: int) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": n, "ignore_eos": True}, "return_logprob": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert all(lp[0] is not None for lp in body["meta_info"]["output_token_logprobs"])
    return [t for _, t, _ in body["meta_info"]["output_token_logprobs"]]


def test_openai_and_native_apis_agree_in_every_layout_and_across_switches(servers):
    one, auto, one_glm, sched = servers
    for ref, srv in ((one, auto), (one_glm, sched)):
        assert _generate(srv.url, PROMPT, 12) == _generate(ref.url, PROMPT, 12)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text and out.usage.completion_tokens == 12
    info = httpx.get(sched.url + "/get_server_info", timeout=30).json()
    assert info["num_switches"] >= 2 and info["switch_refusals"] == 0, info  # live, mid-request
    assert httpx.get(auto.url + "/get_server_info", timeout=30).json()["layout_mode"] == "auto"


def test_metrics_count_the_indexer_cache(servers):
    auto = servers[1]
    text = httpx.get(auto.url + "/metrics", timeout=30).text
    samples = {(s.name, s.labels.get("store")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "splash:kv_bytes_per_token"}
    cfg = PRESETS["tiny-dsa"]
    want = {st.name: st.values_per_token * 8 for st in token_stores(cfg)}  # float64
    assert {k[1]: v for k, v in samples.items()} == want and want["index_k"] > 0
