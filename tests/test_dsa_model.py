"""splash's DSA models (DeepSeek-V3.2, GLM-5 with shared indexer layers) against transformers in float64.

The reference scores the indexer in float32; splash scores a float64 model in float64. Its selection
rule (top index_topk by score, ties to the earlier position) must pick the reference's key sets on every
row whose top-k boundary is not a near-tie in float32 (`near_tie_rows`), and with those sets the logits
agree to 1e-9: whole prefill, chunked prefill then decode through the paged cache (index keys written
beside the latent), mixed batches, greedy tokens. The sparse path is really taken (top-k 8 < context,
and the logits differ from the same weights with a dense top-k).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers_ckpt import Seq, SimpleRunner, hf_greedy, hf_logits
from helpers_dsa import build_dsa_checkpoint, hf_dsa_reference, hf_topk, near_tie_rows

from splash.attention import sparse
from splash.core.model_config import ConfigError, ModelConfig
from splash.model import load_model

torch.set_num_threads(1)
TOL = 1e-9


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=["v32", "glm"])
def pair(request, tmp_path_factory):
    # index_head_dim 48 > d_rope 32: the indexer's heads have a rotated and an unrotated part
    path = build_dsa_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5,
                                index_head_dim=48)
    return path, hf_dsa_reference(path), load_model(path, "float64")


def test_prefill_logits_and_selected_sets_match(pair, monkeypatch):
    path, ref, model = pair
    picked: dict[int, list[frozenset[int]]] = {}
    orig = sparse.subset_candidates

    def spy(layer, idx, rows, ctx, k):
        got = orig(layer, idx, rows, ctx, k)
        picked[layer] = [frozenset(p for p in row if p >= 0) for row in got[1].tolist()]
        return got

    monkeypatch.setattr(sparse, "subset_candidates", spy)
    checked = 0
    for n, seed in ((13, 0), (27, 1), (40, 2)):
        ids = _prompt(n, seed)
        picked.clear()
        got = SimpleRunner(model).all_logits(Seq(ids), n)
        want = hf_topk(ref, ids)
        ties = near_tie_rows(ref, ids)
        assert set(picked) == set(model.cfg.indexer_layers)
        for layer, sets in picked.items():
            rows = [t for t in range(n) if t not in ties.get(layer, set())]
            assert [sets[t] for t in rows] == [want[layer][t] for t in rows], f"layer {layer}: sets differ"
            checked += len(rows)
        if not any(ties.values()):
            assert (got - hf_logits(ref, ids)).abs().max().item() < TOL
    assert checked > 0


def test_chunked_prefill_then_decode_match(pair):
    _, ref, model = pair
    ids = _prompt(36, 11)
    want = hf_logits(ref, ids)
    runner, seq = SimpleRunner(model, page_size=4), Seq(ids)
    rows = [runner.all_logits(seq, 7), runner.all_logits(seq, 5), runner.all_logits(seq, 6)]
    rows += [runner.all_logits(seq, 1) for _ in range(18)]  # decode: each row selects among its keys
    got = torch.cat(rows)
    assert (got - want).abs().max().item() < TOL


def test_greedy_tokens_match_with_mixed_batches(pair):
    _, ref, model = pair
    prompts = [_prompt(n, 30 + n) for n in (5, 12, 19, 26)]
    new = 14
    want = [hf_greedy(ref, p, new) for p in prompts]
    runner = SimpleRunner(model, num_pages=128, page_size=4)
    seqs = [Seq(list(p)) for p in prompts]
    plen = [len(p) for p in prompts]
    step = 0
    while any(len(s.ids) - plen[i] < new for i, s in enumerate(seqs)):
        work = [(s, min(6, len(s.ids) - s.cached)) for i, s in enumerate(seqs)
                if i <= step and len(s.ids) - plen[i] < new]
        logits = runner.step(work)
        for (s, _), row in zip(work, logits):
            if s.cached == len(s.ids):
                s.ids.append(int(row.argmax()))
        step += 1
    assert [s.ids[plen[i]:] for i, s in enumerate(seqs)] == want


def test_sparse_path_is_taken(pair, tmp_path):
    """The same weights with a top-k covering every context give other logits (and equal the dense
    reference), so the parity above is the sparse computation's."""
    path, _, model = pair
    dense = tmp_path / "dense"
    shutil.copytree(path, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 64
    (dense / "config.json").write_text(json.dumps(cfg))
    ids = _prompt(30, 4)
    sparse_logits = SimpleRunner(model).all_logits(Seq(ids), 30)
    dense_logits = SimpleRunner(load_model(str(dense), "float64")).all_logits(Seq(ids), 30)
    assert (sparse_logits - dense_logits).abs().max().item() > 1e-3
    assert (dense_logits - hf_logits(hf_dsa_reference(str(dense)), ids)).abs().max().item() < TOL


def test_bad_indexer_shapes_are_refused_at_load():
    base = {"model_type": "deepseek_v32", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 8,
            "v_head_dim": 4, "q_lora_rank": 4, "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}
    assert ModelConfig.from_dict(base).is_sparse
    for bad, msg in (({"index_head_dim": 4}, "wider than its head"), ({"index_topk": 0}, "positive integer"),
                     ({"q_lora_rank": None}, "q_lora_rank"), ({"qk_rope_head_dim": 7}, "even")):
        with pytest.raises(ConfigError, match=msg):
            ModelConfig.from_dict({**base, **bad})
    glm = {**base, "model_type": "glm_moe_dsa"}
    with pytest.raises(ConfigError, match="indexer_types"):
        ModelConfig.from_dict({**glm, "indexer_types": ["full"]})
    with pytest.raises(ConfigError, match="layer 0"):
        ModelConfig.from_dict({**glm, "indexer_types": ["shared", "full"]})
    assert ModelConfig.from_dict({**glm, "index_topk_pattern": "FS"}).indexer_types == ("full", "shared")
