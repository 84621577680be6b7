"""The engine on CUDA (run with `pytest --cuda`; skipped otherwise, CI is CPU-only).

Float64 on the GPU(s) against transformers on the CPU: greedy tokens identical and every sampled
row's logits within 1e-9 of the single-rank CPU engine, at T = 1 and, with several GPUs, at T = 2 or 4
for each layout (NCCL data plane + gloo control plane, one device per rank, chosen automatically).
"""

from __future__ import annotations

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference
from test_engine_dist import ENGINE, LAYOUTS, NEW, PROMPTS, run

from splash.engine.group import RankGroup
from splash.engine.runner import build_engine

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("v3"), "v3", seed=0)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    eng = build_engine(model=path, num_kv_pages=64, **ENGINE)  # CPU, one rank
    _, logits = run(eng, PROMPTS)
    return path, ref, logits


def _check(eng, ref, ref_logits, what: str) -> None:
    try:
        toks, logits = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert toks == ref, f"{what}: tokens differ from transformers"
    err = max((logits[k].cpu() - ref_logits[k]).abs().max().item() for k in logits)
    assert err < 1e-9, f"{what}: logits differ from the CPU engine by {err:.2e}"


def test_cuda_engine_matches_transformers(v3):
    path, ref, ref_logits = v3
    kw = dict(ENGINE, device="cuda")
    eng = build_engine(model=path, num_kv_pages=64, **kw)
    assert eng.stats()["device"].startswith("cuda")
    _check(eng, ref, ref_logits, "T=1")
    n = torch.cuda.device_count()
    if n < 2:
        return
    world = 4 if n >= 4 else 2
    group = RankGroup.start(world, device="cuda", timeout_s=120)
    try:
        assert group.grid.backend == "nccl"
        for layout in LAYOUTS:
            eng = build_engine(model=path, layout=layout, rank_group=group, num_kv_pages=64, **kw)
            _check(eng, ref, ref_logits, f"{layout} T={world}")
    finally:
        group.close()
