"""EngineConfig (splash/config.py): the one way options reach the engine - from keywords (SGLang's and
vLLM's names too, an unknown one refused naming the nearest), from the CLI (every command the same
flags), validated once with errors that say what to do, resolved for the ranks, printed by the server."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from splash.config import ENV_OVERRIDES, EngineConfig, env_defaults
from splash.core.model_config import ConfigError


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return EngineConfig.from_cli_args(p.parse_args(list(argv)))


def test_unknown_keywords_name_the_nearest_option():
    with pytest.raises(ConfigError, match="unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=8)
    with pytest.raises(ConfigError, match="did you mean 'enable_prefix_caching'"):
        EngineConfig.from_kwargs(enable_prefix_cache=True)
    from splash.llm import LLM

    with pytest.raises(ConfigError, match="did you mean 'num_kv_pages'"):
        LLM("tiny", num_kv_page=8)


def test_peers_names_are_taken_and_must_agree():
    c = EngineConfig.from_kwargs(model_path="m", tp_size=2, context_length=64, max_running_requests=4,
                                 chunked_prefill_size=256, random_seed=3)
    assert (c.model, c.tp, c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens, c.seed) == \
        ("m", 2, 64, 4, 256, 3)
    assert EngineConfig.from_kwargs(tensor_parallel_size=4).tp == 4
    with pytest.raises(ConfigError, match="tp_size=2 disagrees with tp=4"):
        EngineConfig.from_kwargs(tp=4, tp_size=2)


def test_the_cli_reads_every_option_with_the_peers_spellings():
    assert parse() == EngineConfig.from_kwargs()  # nothing given: the defaults (and the environment's)
    c = parse("--model", "small", "--dtype", "float64", "--tp-size", "2", "--chunked-prefill-size", "128",
              "--max-running-requests", "8", "--disable-radix-cache", "--layout", "dop",
              "--switch-schedule", "3:tp", "--attention-form", "mha", "--enforce-eager",
              "--cuda-graph-sizes", "4,1", "--random-seed", "5", "--page-size", "8")
    assert (c.model, c.dtype, c.tp, c.max_num_batched_tokens, c.max_num_seqs) == \
        ("small", "float64", 2, 128, 8)
    assert c.enable_prefix_caching is False and c.layout == "dop" and c.schedule == [(3, "tp")]
    assert c.kernels.attention_form == "mha" and c.kernels.enforce_eager and not c.kernels.cuda_graphs
    assert c.cuda_graph_sizes == (1, 4) and c.seed == 5 and c.page_size == 8
    assert parse("--tensor-parallel-size", "4").tp == 4 and parse("--ranks", "2").tp == 2
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    # every field with a flag is on the parser, each under its group
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    flags = {s for a in p._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("flag"):
            assert f.metadata["flag"] in flags, f.name


@pytest.mark.parametrize("kw, msg", [
    ({"layout": "ring"}, "unknown layout 'ring'; choose auto or one of tp, dp, cp, dop"),
    ({"page_size": 0}, "page_size must be a positive integer"),
    ({"switch_schedule": "8dp"}, "write STEP:LAYOUT pairs"),
    ({"switch_schedule": "8:xx"}, "unknown layout 'xx' at step 8"),
    ({"memory_per_rank": "2 lemons"}, "write e.g. 2GiB"),
    ({"attention_form": "latent"}, "unknown attention form"),
    ({"switch_mode": "eager"}, "--switch-mode must be one of overlapped, blocking"),
    ({"switch_margin": 1.5}, r"switch_margin must be in \[0, 1\)"),
    ({"max_model_len": 1}, "max_model_len must be >= 2"),
])
def test_bad_values_are_refused_with_the_fix(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig(**kw)


def test_resolved_fills_what_the_ranks_need():
    c = EngineConfig().resolved(1, 4096)
    assert (c.tp, c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.start_layout) == \
        (1, 64, 512, 4096, "tp")
    s = EngineConfig(serving=True).resolved(2, 4096)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.start_layout, s.auto, s.switching) == \
        (256, 4096, "dop", True, True)
    assert EngineConfig(layout="dp", max_num_seqs=8).resolved(2, 64).max_num_seqs == 8
    with pytest.raises(ConfigError, match="needs T > 1 ranks"):
        EngineConfig(switch_schedule="3:dp").resolved(1, 64)
    assert dataclasses.replace(s) == s  # frozen, comparable, picklable: what every rank receives
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tp = 3  # type: ignore[misc]


def test_environment_overrides_are_the_listed_ones(monkeypatch):
    for var in ENV_OVERRIDES:
        monkeypatch.delenv(var, raising=False)
    assert env_defaults() == {}
    env = {"SPLASH_ATTN_FORM": "mha", "SPLASH_NATIVE": "0", "SPLASH_CUDA_GRAPHS": "0",
           "SPLASH_CUDA_GRAPH_SIZES": "2,1", "SPLASH_CHECK_BOOKS": "1"}
    got = env_defaults(env)
    assert {ENV_OVERRIDES[k][0] for k in env} == set(got)
    c = EngineConfig(**got)
    assert c.attention_form == "mha" and c.enforce_eager and not c.cuda_graphs and c.check_books
    monkeypatch.setenv("SPLASH_NATIVE", "0")
    assert EngineConfig.from_kwargs().enforce_eager  # (an explicit option wins over the environment)
    assert not EngineConfig.from_kwargs(enforce_eager=False).enforce_eager


def test_the_server_prints_the_engine_config():
    from fastapi.testclient import TestClient

    from splash.engine.async_engine import AsyncEngine
    from splash.server.app import create_app

    eng = AsyncEngine.from_args(model="tiny", dtype="float32", num_kv_pages=16, max_num_seqs=3, device="cpu")
    with TestClient(create_app(eng)) as c:
        info = c.get("/get_server_info").json()
    cfg = info["engine_config"]
    assert cfg["scheduler"]["max_num_seqs"] == 3 and cfg["cache"]["num_kv_pages"] == 16
    assert cfg["model"]["dtype"] == "float32" and cfg["parallel"]["tp"] == 1
    assert info["max_running_requests"] == 3 and info["tp_size"] == 1  # SGLang's names beside it
