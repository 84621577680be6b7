"""A launch command copied from SGLang's or vLLM's docs runs: the recipes' command lines for DeepSeek-V3 /
V3.2, GLM and Kimi-K2, as argument lists, go through the real `splash serve` parser into an EngineConfig
with splash's meaning of each flag (splash/config.py's aliases, splash/flags.py's table); a flag splash
cannot honour is refused naming itself, the reason and splash's equivalent; the same names work as
Python keywords (`LLM(**kw)`, `Engine(**kw)`).

vLLM's `vllm serve MODEL` takes the model as a positional argument; splash takes `--model`, so the vLLM
lines below start with `--model MODEL` in its place.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from splash.chat import reasoning_parser, tool_parser
from splash.cli import build_parser
from splash.commands.serve import engine_config
from splash.config import EngineConfig
from splash.core.model_config import ConfigError
from splash.flags import PEER_KEYS

V32 = "deepseek-ai/DeepSeek-V3.2-Exp"
MTP = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
       "--speculative-num-draft-tokens", "4"]

# (argv, expected EngineConfig fields, expected server flags)
RECIPES = [
    # sgl-project/sglang docs/basic_usage/deepseek_v32.md, "Launch DeepSeek V3.2 with SGLang"
    (["--model", V32, "--tp", "8", "--dp", "8", "--enable-dp-attention"], {"tp": 8, "layout": "dp"}, {}),
    (["--model", V32, "--tp", "8", "--ep", "8", "--dp", "8", "--enable-dp-attention"],
     {"tp": 8, "layout": "dp", "expert_parallel": "ep"}, {}),
    (["--model", V32, "--tp", "8"], {"tp": 8, "layout": None, "expert_parallel": "auto"}, {}),
    # ... "Multi-token Prediction"
    (["--model", V32, "--tp", "8", "--dp", "8", "--enable-dp-attention", *MTP],
     {"tp": 8, "layout": "dp", "speculative_algorithm": "MTP", "num_drafts": 3}, {}),
    # ... "Function Calling and Reasoning Parser" (DeepSeek-V3.2)
    (["--model-path", "deepseek-ai/DeepSeek-V3.2", "--trust-remote-code", "--tp-size", "8", "--dp-size", "8",
      "--enable-dp-attention", "--tool-call-parser", "deepseekv32", "--reasoning-parser", "deepseek-v3"],
     {"model": "deepseek-ai/DeepSeek-V3.2", "tp": 8, "layout": "dp", "tool_call_parser": "deepseekv32",
      "reasoning_parser": "deepseek-v3"}, {}),
    # sgl-project/sglang docs/basic_usage/deepseek_v3.md, "Multi-token Prediction"
    (["--model-path", "deepseek-ai/DeepSeek-V3-0324", "--speculative-algorithm", "EAGLE",
      "--trust-remote-code", "--tp", "8"], {"tp": 8, "speculative_algorithm": "MTP", "num_drafts": 3}, {}),
    # ... "Function calling for DeepSeek Models"
    (["--model", "deepseek-ai/DeepSeek-V3-0324", "--tp", "8", "--port", "30000", "--host", "0.0.0.0",
      "--mem-fraction-static", "0.9", "--tool-call-parser", "deepseekv3", "--chat-template",
      "./examples/chat_template/tool_chat_template_deepseekv3.jinja"],
     {"tp": 8, "mem_fraction_static": 0.9, "tool_call_parser": "deepseekv3"},
     {"port": 30000, "host": "0.0.0.0"}),
    # ... "Data Parallelism Attention"
    (["--model", "deepseek-ai/DeepSeek-V3", "--enable-dp-attention", "--tp", "8", "--dp", "8"],
     {"tp": 8, "layout": "dp"}, {}),
    # sgl-project/sglang docs/platforms/cpu_server.md, "Example: Running DeepSeek-V3.1-Terminus" (FP8)
    (["--model", "deepseek-ai/DeepSeek-V3.1-Terminus", "--trust-remote-code", "--disable-overlap-schedule",
      "--device", "cpu", "--host", "0.0.0.0", "--enable-torch-compile", "--torch-compile-max-bs", "4",
      "--tp", "6"], {"tp": 6, "device": "cpu"}, {"host": "0.0.0.0"}),
    # sgl-project/sglang docs/basic_usage/glm45.md, "EAGLE Speculative Decoding"
    (["--model-path", "zai-org/GLM-4.6-FP8", "--tp-size", "8", "--tool-call-parser", "glm45",
      "--reasoning-parser", "glm45", *MTP, "--mem-fraction-static", "0.9", "--served-model-name",
      "glm-4.6-fp8", "--enable-custom-logit-processor"],
     {"tp": 8, "speculative_algorithm": "MTP", "num_drafts": 3, "mem_fraction_static": 0.9},
     {"served_model_name": "glm-4.6-fp8"}),
    # sgl-project/sglang docs/basic_usage/kimi_k2_5.md, "Launch Kimi-K2.5 with SGLang"
    (["--model-path", "moonshotai/Kimi-K2.5", "--tp", "8", "--trust-remote-code", "--tool-call-parser",
      "kimi_k2", "--reasoning-parser", "kimi_k2"],
     {"tp": 8, "tool_call_parser": "kimi_k2", "reasoning_parser": "kimi_k2"}, {}),
    # vllm-project/recipes DeepSeek/DeepSeek-V3_2-Exp.md, "Serving on 8xH200": EP/DP, then TP
    (["--model", V32, "-dp", "8", "--enable-expert-parallel"],
     {"tp": 8, "layout": "dp", "expert_parallel": "ep"}, {}),
    (["--model", V32, "-tp", "8"], {"tp": 8}, {}),
    # vllm-project/recipes DeepSeek/DeepSeek-V3_2.md, "Launching DeepSeek-V3.2"
    (["--model", "deepseek-ai/DeepSeek-V3.2", "--tensor-parallel-size", "8", "--tokenizer-mode",
      "deepseek_v32", "--tool-call-parser", "deepseek_v32", "--reasoning-parser", "deepseek_v3"],
     {"tp": 8, "tool_call_parser": "deepseek_v32", "reasoning_parser": "deepseek-v3"}, {}),
    # vllm-project/recipes GLM/GLM5.md, "Serving FP8 Model on 8xH200"
    (["--model", "zai-org/GLM-5-FP8", "--tensor-parallel-size", "8", "--speculative-config.method", "mtp",
      "--speculative-config.num_speculative_tokens", "3", "--tool-call-parser", "glm47", "--reasoning-parser",
      "glm45", "--enable-auto-tool-choice", "--served-model-name", "glm-5-fp8"],
     {"tp": 8, "speculative_algorithm": "MTP", "num_drafts": 3, "enable_auto_tool_choice": True},
     {"served_model_name": "glm-5-fp8"}),
    # vllm-project/recipes moonshotai/Kimi-K2.md, "Data Parallelism + Expert Parallelism", node 0's command
    # without its multi-node flags (those are refused below, with splash's --nnodes equivalent)
    (["--model", "moonshotai/Kimi-K2-Instruct", "--port", "8000", "--served-model-name", "kimi-k2",
      "--trust-remote-code", "--data-parallel-size", "16", "--enable-expert-parallel",
      "--max-num-batched-tokens", "8192", "--max-num-seqs", "256", "--gpu-memory-utilization", "0.85",
      "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2"],
     {"tp": 16, "layout": "dp", "expert_parallel": "ep", "max_num_batched_tokens": 8192, "max_num_seqs": 256,
      "mem_fraction_static": 0.85}, {"port": 8000, "served_model_name": "kimi-k2"}),
]


def serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_config(*argv: str) -> EngineConfig:
    return engine_config(serve_args(["--model", "m", *argv]))


@pytest.mark.parametrize("argv, fields, server", RECIPES, ids=[" ".join(r[0][2:])[:60] for r in RECIPES])
def test_a_recipe_command_line_parses_into_splash_options(argv, fields, server):
    args = serve_args(argv)
    c = engine_config(args)
    assert {k: getattr(c, k) for k in fields} == fields
    assert {k: getattr(args, k) for k in server} == server
    if c.tool_call_parser:  # a server resolves these names when the first chat request comes
        tool_parser(c.tool_call_parser)
    if c.reasoning_parser:
        reasoning_parser(c.reasoning_parser)


@pytest.mark.parametrize("argv, msg", [
    # tree drafts (SGLang's EAGLE with topk > 1)
    ([*MTP[:6], "--speculative-eagle-topk", "2"], r"--speculative-eagle-topk 2: tree drafts .* give "
                                                  r"--speculative-eagle-topk 1"),
    (["--attention-backend", "fa3"], r"--attention-backend fa3: a GPU attention kernel .* triton"),
    (["--decode-attention-backend", "flashinfer"], r"--decode-attention-backend flashinfer: a GPU attention"),
    # sglang deepseek_v32.md, "Launch with TP on MI30x/MI35x"
    (["--tp", "8", "--nsa-prefill-backend", "tilelang", "--nsa-decode-backend", "tilelang"],
     r"--nsa-prefill-backend tilelang: a GPU attention kernel"),
    (["--attention-backend", "magic"], r"--attention-backend magic: an attention backend splash does not"),
    (["--tp", "8", "--ep", "8", "--moe-a2a-backend", "deepep"],
     r"--moe-a2a-backend deepep: .*--expert-parallel"),
    # sglang deepseek_v3.md, "Data Parallelism Attention" on 2 nodes: DP groups of 8 TP ranks
    (["--enable-dp-attention", "--tp", "16", "--dp", "2"], r"--dp-size 2 with --tp 16: .* give --dp-size 16"),
    (["--tp", "8", "--dp", "8"], r"--dp-size 8 without --enable-dp-attention .* add --enable-dp-attention"),
    (["--tp", "8", "--ep", "4"], r"--ep-size 4 with --tp 8: .* give --ep-size 8 .* or --ep-size 1"),
    (["-tp", "2", "-dp", "4"], r"--data-parallel-size 4 with --tensor-parallel-size 2 .* --layout dp"),
    (["--layout", "tp", "--tp", "2", "--dp", "2", "--enable-dp-attention"],
     r"--dp-size means layout='dp', but layout='tp' is given too"),
    # vllm recipes moonshotai/Kimi-K2.md: TP8 + PP2 over two nodes, and DP16 + EP over two nodes
    (["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"],
     r"--pipeline-parallel-size 2: splash has no pipeline parallelism .* --tp T"),
    (["--data-parallel-size", "16", "--data-parallel-size-local", "8", "--data-parallel-address", "10.0.0.1"],
     r"--data-parallel-size-local: .* --nnodes N --node-rank R --dist-init-addr HOST:PORT"),
    (["--headless"], r"--headless: .* --nnodes N"),
    (["--quantization", "fp8"], r"--quantization: splash reads the checkpoint's own quantization_config"),
    # sglang deepseek_v32.md, "PD Disaggregation"
    # (T > 1 on each side is served; a side over several nodes is not yet)
    (["--disaggregation-mode", "prefill", "--tp", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"],
     r"--disaggregation-mode prefill with --nnodes 2: a PD side spans one node"),
    (["--enable-nsa-prefill-context-parallel"], r"--enable-nsa-prefill-context-parallel: .* --layout cp"),
    (["--tokenizer-mode", "mistral"], r"--tokenizer-mode mistral: .* accepted: auto"),
    (["--num-kv-pages", "8", "--max-total-tokens", "64"], r"--num-kv-pages .* --max-total-tokens .*give one"),
])
def test_a_flag_splash_cannot_honour_is_refused_by_name_with_its_equivalent(argv, msg):
    with pytest.raises(ConfigError, match=msg):
        serve_config(*argv)


def test_each_accepted_flag_means_a_splash_option():
    assert serve_config("--attention-backend", "triton").attention_kernel == "triton"
    assert serve_config("--attention-backend", "torch_native").attention_kernel == "torch"
    assert serve_config("--attention-backend", "intel_amx").attention_kernel == "native"
    assert serve_config("--attention-backend", "nsa").attention_kernel == "auto"
    assert serve_config("--cuda-graph-max-bs", "48").cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 48)
    assert serve_config("--cuda-graph-max-bs", "1").cuda_graph_sizes == (1,)
    assert serve_config("--cuda-graph-bs", "16", "8", "24").cuda_graph_sizes == (8, 16, 24)
    assert serve_config("--moe-a2a-backend", "none", "--disaggregation-mode", "null", "-pp", "1").tp is None
    c = serve_config("--tp", "8", "--ep", "1")
    assert c.expert_parallel == "tp"
    assert serve_config("--ep", "4").tp == 4  # (SGLang: EP over the ranks, T given by --ep alone)
    assert serve_config("--speculative-algorithm", "NEXTN").speculative_algorithm == "MTP"
    assert serve_config("--block-size", "1").page_size == 1  # (vLLM's name)
    c = serve_config("--max-total-tokens", "4096", "--gpu-memory-utilization", "0.95")
    assert (c.max_total_tokens, c.mem_fraction_static) == (4096, 0.95)
    assert serve_config("--enable-dp-attention").layout is None  # (SGLang's dp 1: no DP attention)
    assert serve_config("--enable-metrics", "--enable-chunked-prefill", "--disable-log-requests") == \
        serve_config()
    with pytest.raises(SystemExit):  # argparse: not a fraction
        serve_config("--mem-fraction-static", "1.5")
    for bad in ({"mem_fraction_static": 0.0}, {"max_total_tokens": 0}):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


def test_the_flags_are_listed_with_their_meaning_in_help():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--enable-dp-attention", "--dp-size", "-dp", "--ep-size", "--enable-expert-parallel",
                 "--mem-fraction-static", "--gpu-memory-utilization", "--max-total-tokens",
                 "--attention-backend", "--cuda-graph-max-bs", "--speculative-eagle-topk",
                 "--trust-remote-code", "--model-path", "-tp"):
        assert flag in text, flag
    assert "SGLang / vLLM launch flags" in text
    assert not set(PEER_KEYS) & {f.name for f in dataclasses.fields(EngineConfig)}  # (a keyword, one meaning)


def test_the_same_names_work_as_python_keywords():
    c = EngineConfig.from_kwargs(model_path="m", tp_size=8, dp_size=8, enable_dp_attention=True,
                                 trust_remote_code=True, mem_fraction_static=0.8, enable_metrics=True)
    assert (c.model, c.tp, c.layout, c.mem_fraction_static) == ("m", 8, "dp", 0.8)
    c = EngineConfig.from_kwargs(data_parallel_size=8, enable_expert_parallel=True,
                                 gpu_memory_utilization=0.9)
    assert (c.tp, c.layout, c.expert_parallel, c.mem_fraction_static) == (8, "dp", "ep", 0.9)
    c = EngineConfig.from_kwargs(tp=8, ep_size=8, speculative_algorithm="EAGLE", speculative_eagle_topk=1,
                                 cuda_graph_max_bs=8, trust_remote_code=False)
    assert (c.expert_parallel, c.speculative_algorithm, c.cuda_graph_sizes) == ("ep", "MTP", (1, 2, 4, 8))
    assert EngineConfig.from_kwargs(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek-r1"
    with pytest.raises(ConfigError, match="tree drafts"):
        EngineConfig.from_kwargs(speculative_eagle_topk=2)
    with pytest.raises(ConfigError, match="--moe-a2a-backend deepep"):
        EngineConfig.from_kwargs(moe_a2a_backend="deepep")
    with pytest.raises(ConfigError, match="did you mean 'dp_size'"):
        EngineConfig.from_kwargs(dp_sizes=8)
    with pytest.raises(ConfigError, match="enable_ep_moe=False disagrees with enable_expert_parallel=True"):
        EngineConfig.from_kwargs(enable_expert_parallel=True, enable_ep_moe=False)
    from splash.llm import LLM

    with pytest.raises(ConfigError, match="--data-parallel-size 2 with --tensor-parallel-size 4"):
        LLM("tiny", tensor_parallel_size=4, data_parallel_size=2)


def test_max_total_tokens_caps_the_kv_pool():
    from splash.engine.build import build_engine

    eng = build_engine(model="tiny", dtype="float32", page_size=16, max_total_tokens=40, device="cpu")
    assert eng.stats()["kv_pages_total"] == 3  # ceil(40 / 16)


def test_a_gpu_pool_takes_mem_fraction_static_of_the_device(monkeypatch):
    """The GPU branch of the default pool, with the device's memory faked (no GPU needed): weights + KV
    within F of the device, the rest (others' use, activations) left alone; --max-total-tokens caps it."""
    from types import SimpleNamespace

    import torch

    from splash.kv.pool import KVPool
    from splash.worker import sizing

    gib, mib = 2**30, 2**20
    monkeypatch.setattr(KVPool, "bytes_per_page", staticmethod(lambda *a, **k: mib))
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 10 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 16 * gib))

    def pages(**kw):
        config = EngineConfig(max_num_seqs=4096, max_model_len=1 << 20, **kw)
        spec = SimpleNamespace(config=config, page_size=16, model=None, dtype=torch.bfloat16,
                               kv_format="bfloat16")
        return sizing.kv_pages(spec, torch.device("cuda"), 0, 0)

    assert pages() == int(10 * gib * 0.85) // mib  # the default: a share of what is free
    assert pages(mem_fraction_static=0.75) == 6 * 1024  # 10 GiB free less the 4 GiB outside the share
    assert pages(mem_fraction_static=0.75, max_total_tokens=16 * 100 - 3) == 100
    with pytest.raises(ConfigError, match="within --mem-fraction-static 0.3 .raise it."):
        pages(mem_fraction_static=0.3)  # (16 GiB x 0.3 is less than the 6 GiB already in use)
