"""The engine on CUDA (run with `pytest --cuda -m cuda`; skipped otherwise, CI is CPU-only).

Float64 on the GPU(s): greedy tokens identical to transformers at T = 1, and, with several GPUs, at
T = 2 or 4 for each layout and through all 12 switch directions in both switch modes (NCCL data plane
+ gloo control plane, one device per rank), every sampled row's logits within 1e-9 of the T = 1 CUDA
engine. The T = 1 CUDA engine itself is held to the CPU engine at 1e-5, not 1e-9: the router GEMM and
the rotary tables are float32 even in a float64 model (as in transformers), and cuBLAS/CUDA's cosf
round them differently from the CPU's (measured ~7e-7 on the logits by perturbing only that rounding).
`tests/cuda_check.sh` is the one-GPU device check (switches on two ranks sharing one GPU, bf16, syncs).
"""

from __future__ import annotations

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference
from test_engine_dist import ENGINE, LAYOUTS, NEW, PROMPTS, run
from test_engine_switch import ALL12

from splash.engine.build import build_engine
from splash.engine.group import RankGroup

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]
CROSS_DEVICE = 1e-5  # float32 router/rotary rounding, CUDA vs CPU (see the module docstring)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("v3"), "v3", seed=0)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    eng = build_engine(model=path, num_kv_pages=64, **ENGINE)  # CPU, one rank
    _, logits = run(eng, PROMPTS)
    return path, ref, logits


def _check(eng, ref, ref_logits, what: str, bound: float) -> dict:
    try:
        toks, logits = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert toks == ref, f"{what}: tokens differ from transformers"
    assert logits.keys() == ref_logits.keys(), f"{what}: sampled rows differ"
    err = max((logits[k].cpu() - ref_logits[k].cpu()).abs().max().item() for k in logits)
    assert err < bound, f"{what}: logits differ from the reference engine by {err:.2e}"
    return logits


def test_cuda_engine_matches_transformers(v3):
    path, ref, cpu_logits = v3
    kw = dict(ENGINE, device="cuda")
    eng = build_engine(model=path, num_kv_pages=64, **kw)
    assert eng.stats()["device"].startswith("cuda")
    one = _check(eng, ref, cpu_logits, "T=1 CUDA vs CPU", CROSS_DEVICE)
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("T=1 checked; the multi-rank layouts need one GPU per rank (NCCL)")
    world = 4 if n >= 4 else 2
    group = RankGroup.start(world, device="cuda", timeout_s=120)
    try:
        assert group.grid.backend == "nccl"
        for layout in LAYOUTS:
            eng = build_engine(model=path, layout=layout, rank_group=group, num_kv_pages=64, **kw)
            _check(eng, ref, one, f"{layout} T={world}", 1e-9)
        for mode in ("overlapped", "blocking"):  # the side stream and async NCCL transfers
            eng = build_engine(model=path, layout="tp", rank_group=group, num_kv_pages=96,
                               switch_schedule=ALL12, switch_mode=mode, **kw)
            _check(eng, ref, one, f"all 12 switches T={world} {mode}", 1e-9)
    finally:
        group.close()
