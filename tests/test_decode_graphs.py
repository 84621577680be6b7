"""The CUDA-only parts of the decode step, checked on CPU where their logic allows it (the GPU itself is
checked by tests/cuda_check.sh): the attention-kernel choice (splash/attention/kernels.py), the MoE's
sync-free dense form (MoE._dense, what CUDA decode steps and graphs run), and the padded static-buffer
forward the CUDA graphs capture (splash/worker/cuda_graph.py with capture=False: the same buffers,
padding and context, run eagerly), which must give transformers' greedy tokens in float64 and the plain
engine's logits within 1e-9.
"""

from __future__ import annotations

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference
from test_engine_dist import ENGINE, NEW, PROMPTS, run
from test_fast_paths import TINY, _moe

from splash.attention import native
from splash.attention.kernels import Kernels
from splash.config import EngineConfig, KernelConfig
from splash.engine.build import build_engine
from splash.worker import cuda_graph


def _kernels() -> Kernels:
    """A rank's kernels as an engine made now builds them (SPLASH_ATTN_KERNEL read into its config)."""
    return Kernels(EngineConfig.from_kwargs(enforce_eager=False).kernels)


def test_kernel_choice(monkeypatch) -> None:
    q = torch.zeros(1, 1, 1, dtype=torch.float64)
    monkeypatch.delenv("SPLASH_ATTN_KERNEL", raising=False)
    want = "native" if native.library() is not None else "torch"
    assert _kernels().kernel_for(q) == want and _kernels().supports(q) == (want == "native")
    assert _kernels().kernel_for(q.to(torch.float16)) == "torch"  # the C kernel has no fp16
    monkeypatch.setenv("SPLASH_ATTN_KERNEL", "torch")
    assert _kernels().kernel_for(q) == "torch" and not _kernels().supports(q)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (tests/test_triton_mla.py sets it)
    monkeypatch.setenv("SPLASH_ATTN_KERNEL", "triton")  # not on a CPU tensor, outside the interpreter
    assert _kernels().kernel_for(q) == "torch"
    monkeypatch.delenv("SPLASH_ATTN_KERNEL")
    assert cuda_graph.enabled(KernelConfig())
    eager = EngineConfig(enforce_eager=True).kernels  # --enforce-eager: no fast kernel, no CUDA graph
    assert Kernels(eager).kernel_for(q) == "torch" and not cuda_graph.enabled(eager)
    assert not cuda_graph.enabled(EngineConfig(cuda_graphs=False).kernels)  # --disable-cuda-graph
    # the environment overrides (tests, benchmarks) set the same fields
    for var in ("SPLASH_NATIVE", "SPLASH_CUDA_GRAPHS", "SPLASH_CUDA_GRAPH_SIZES", "SPLASH_ATTN_FORM"):
        monkeypatch.delenv(var, raising=False)
    assert EngineConfig.from_kwargs().kernels == KernelConfig()
    monkeypatch.setenv("SPLASH_NATIVE", "0")
    assert EngineConfig.from_kwargs().enforce_eager
    monkeypatch.setenv("SPLASH_NATIVE", "1")
    monkeypatch.setenv("SPLASH_CUDA_GRAPHS", "0")
    assert not cuda_graph.enabled(EngineConfig.from_kwargs().kernels)


def test_capture_sizes(monkeypatch) -> None:
    monkeypatch.delenv("SPLASH_CUDA_GRAPH_SIZES", raising=False)
    assert cuda_graph.capture_sizes(EngineConfig.from_kwargs().kernels) == cuda_graph.DEFAULT_SIZES
    monkeypatch.setenv("SPLASH_CUDA_GRAPH_SIZES", "8, 2,1,2")
    assert cuda_graph.capture_sizes(EngineConfig.from_kwargs().kernels) == (1, 2, 8)
    assert EngineConfig(cuda_graph_sizes="4,2").kernels.cuda_graph_sizes == (2, 4)  # --cuda-graph-sizes
    monkeypatch.setenv("SPLASH_CUDA_GRAPH_SIZES", "0,4")
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        EngineConfig.from_kwargs()


@pytest.mark.parametrize("world", [1, 2])
def test_dense_moe_equals_the_routed_paths(world: int) -> None:
    moe = _moe(torch.float64, rank=world - 1, world=world)
    for n in (1, 3, 16):
        x = torch.randn(n, TINY.hidden_size, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        want = moe(x)  # CPU: the routed path
        w, idx = moe.gate(x)
        got = moe._dense(x, w, idx)
        if moe.shared is not None:
            got = got + moe.shared(x)
        assert got.dtype == x.dtype
        assert (got - want).abs().max().item() < 1e-14 * want.abs().max().item()


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("v3"), "v3", seed=4)
    hf = hf_reference(path)
    return path, [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_padded_static_decode_forward(v3) -> None:
    path, ref = v3
    plain = build_engine(model=path, num_kv_pages=64, **ENGINE)
    toks0, logits0 = run(plain, PROMPTS)
    plain.shutdown()
    eng = build_engine(model=path, num_kv_pages=64, **ENGINE)
    runner = eng.runner
    assert runner.graphs is None  # CPU: never graphs
    graphs = runner.graphs = cuda_graph.DecodeGraphs(runner.model, runner.pool, runner.kernels,
                                                     sizes=(1, 4, 8), capture=False)
    fills = []
    real_fill = graphs._fill
    graphs._fill = lambda size, ids, ctx: fills.append((size, len(ctx.seqs))) or real_fill(size, ids, ctx)
    toks, logits = run(eng, PROMPTS)
    eng.shutdown()
    assert graphs.replays == len(fills) > 0, "no decode step went through the static buffers"
    assert any(size > b for size, b in fills), f"no step was padded: {fills}"
    assert toks == ref == toks0
    assert logits.keys() == logits0.keys()
    err = max((logits[k] - logits0[k]).abs().max().item() for k in logits)
    assert err < 1e-9, err
