"""FP8 block-quantised checkpoints (DeepSeek-V3's float8_e4m3fn weights + 128x128 `weight_scale_inv`)
are dequantised on load and give exactly what the dequantised weights give."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers_ckpt import Seq, SimpleRunner, build_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from splash.model import load_model
from splash.model.loader import CheckpointReader

torch.set_num_threads(1)
FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
QUANTISED = re.compile(r".*(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|"
                       r"down_proj)\.weight$")
BLOCK = 128


def _quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale = amax / 448 (e4m3's max), q = w / scale in float8."""
    r, c = w.shape
    nr, nc = -(-r // BLOCK), -(-c // BLOCK)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    q = torch.empty(r, c, dtype=FP8)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = (blk.abs().max() / 448.0).clamp(min=1e-12).float()
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s.double()).to(FP8)
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double().repeat_interleave(BLOCK, 0)[: q.shape[0]].repeat_interleave(BLOCK, 1)[:, : q.shape[1]]
    return q.double() * s


def quantised(tensors: dict[str, torch.Tensor], quantise) -> tuple[dict, dict]:
    """(the checkpoint as the hub ships it: FP8 + `_scale_inv` for the names `quantise` accepts, the same
    dequantised in float64)."""
    fp8, deq = {}, {}
    for k, v in tensors.items():
        if quantise(k):
            q, s = _quantise(v)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            deq[k] = _dequantise(q, s)
        else:
            fp8[k] = deq[k] = v
    return fp8, deq


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(original, fp8, dequantised) checkpoint dirs; dims > 128 so blocks are both whole and partial."""
    root = tmp_path_factory.mktemp("fp8")
    orig = build_checkpoint(root / "orig", "v3", seed=2, hidden_size=160, intermediate_size=272)
    with safe_open(os.path.join(orig, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fp8, deq = quantised(tensors, QUANTISED.match)
    with open(os.path.join(orig, "config.json")) as f:
        cfg = json.load(f)
    out = {}
    for name, ts, qc in (("fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [BLOCK, BLOCK]}), ("deq", deq, None)):
        d = root / name
        d.mkdir()
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        c = dict(cfg)
        if qc:
            c["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(c))
        out[name] = str(d)
    return orig, out["fp8"], out["deq"]


def test_fp8_checkpoint_matches_its_dequantised_original(ckpts):
    orig, fp8, deq = ckpts
    with safe_open(os.path.join(fp8, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.self_attn.q_b_proj.weight").dtype == FP8
    ids = torch.randint(3, 97, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for name, path in (("fp8", fp8), ("deq", deq), ("orig", orig)):
        runner, seq = SimpleRunner(load_model(path, "float64")), Seq(ids)
        runs[name] = torch.cat([runner.all_logits(seq, 15)] + [runner.all_logits(seq, 1) for _ in range(6)])
    assert (runs["fp8"] - runs["deq"]).abs().max().item() < 1e-12
    # quantisation really happened: the original weights give visibly different logits
    assert (runs["fp8"] - runs["orig"]).abs().max().item() > 1e-4


def test_fp8_slices_cross_block_boundaries(ckpts):
    """A rank reading only its heads' rows/columns dequantises with the right block scales."""
    _, fp8, deq = ckpts
    a, b = CheckpointReader(fp8, {"weight_block_size": [BLOCK, BLOCK]}), CheckpointReader(deq)
    name = "model.layers.1.self_attn.q_b_proj.weight"  # 4 heads x 44 = 176 rows: block edge at 128
    for rows, cols in (((88, 176), None), ((100, 140), (3, 17)), (None, (5, 20))):
        assert torch.equal(a.get(name, torch.float64, rows=rows, cols=cols),
                           b.get(name, torch.float64, rows=rows, cols=cols))
    full = load_model(deq, "float64")
    for rank in (0, 1):
        part = load_model(fp8, "float64", rank=rank, world=2)
        mla = part.layers[2].self_attn
        want = full.layers[2].self_attn.head_tensors(mla.heads)
        for k, v in mla.head_tensors().items():
            assert torch.equal(v, want[k]), k


def test_fp8_without_scale_is_a_clear_error(ckpts, tmp_path):
    from splash.core.model_config import ConfigError

    _, fp8, _ = ckpts
    with safe_open(os.path.join(fp8, "model.safetensors"), framework="pt") as f:
        ts = {k: f.get_tensor(k) for k in f.keys() if not k.endswith("_scale_inv")}
    save_file(ts, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(fp8, "config.json")).read())
    with pytest.raises(ConfigError, match="without .*scale_inv"):
        load_model(str(tmp_path), "float64")
