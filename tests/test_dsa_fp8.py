"""A DSA checkpoint as the hub ships DeepSeek-V3.2: FP8 128x128 block-quantised projections, the
indexer's wq_b and wk among them (weights_proj and the LayerNorm stay in high precision), sharded over
two safetensors files with an index. It loads, dequantises exactly, and serves sparse attention."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers_ckpt import Seq, SimpleRunner
from helpers_dsa import build_dsa_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file
from test_fp8_load import BLOCK, FP8, quantised

from splash.model import load_model

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
QUANTISED = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
             "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
             "indexer.wq_b.weight", "indexer.wk.weight")


def _write_sharded(tensors: dict[str, torch.Tensor], d: str, cfg: dict) -> None:
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    os.makedirs(d)
    wmap = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(d, fname), metadata={"format": "pt"})
        wmap.update(dict.fromkeys(keys, fname))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("kind", ["v32", "glm"])
def test_fp8_sharded_dsa_checkpoint(tmp_path, kind):
    orig = build_dsa_checkpoint(tmp_path / "orig", kind, seed=4, hidden_size=160, index_head_dim=48,
                                index_n_heads=4)
    with safe_open(os.path.join(orig, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    with open(os.path.join(orig, "config.json")) as f:
        cfg = json.load(f)
    fp8, deq = quantised(tensors, lambda k: k.endswith(QUANTISED))
    assert any(".indexer.wk.weight_scale_inv" in k for k in fp8)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [BLOCK, BLOCK]}
    _write_sharded(fp8, str(tmp_path / "fp8"), {**cfg, "quantization_config": qc})
    _write_sharded(deq, str(tmp_path / "deq"), cfg)
    ids = torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {}
    for name in ("fp8", "deq", "orig"):
        path = orig if name == "orig" else str(tmp_path / name)
        runner, seq = SimpleRunner(load_model(path, "float64")), Seq(ids)
        runs[name] = torch.cat([runner.all_logits(seq, 20)] + [runner.all_logits(seq, 1) for _ in range(10)])
    assert (runs["fp8"] - runs["deq"]).abs().max().item() < 1e-12
    assert (runs["fp8"] - runs["orig"]).abs().max().item() > 1e-4  # the quantisation is real
