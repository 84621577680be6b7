"""Shared test fixtures: tiny DeepSeek-V3/V2 checkpoints built with transformers, the transformers
reference forward (float64), and a minimal driver that runs splash's model over a paged KV pool.

Other tests import these (`from tests.helpers_ckpt import ...` or `from helpers_ckpt import ...`).
Checkpoints are written in float64 so both sides read identical weights.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# Dimensions small enough for a CPU test in seconds, but with every feature on: MoE with shared
# experts and groups, a dense first layer, q_lora, several heads, top-k >= 3 (ordering of sums).
# transformers computes the router (sigmoid) and V2's rotary (complex product) in float32 even in a
# float64 model, and those float32 kernels round a tensor's scalar tail differently from its vector
# body. d_rope = 32 and 32 experts make every such tensor whole vectors (AVX2 and AVX-512), so the
# reference's full-sequence pass has no tail and parity holds to float64 precision; splash itself
# always takes the vector path (see splash/model/moe.py and rope.py).
BASE: dict[str, Any] = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=32,
    v_head_dim=10, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.9,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}


def hf_config(kind: str = "v3", **overrides: Any):
    """A transformers config. kind: "v3" (q_lora, noaux_tc), "v2" (no q_lora, greedy),
    "v2-group" (no q_lora, group_limited_greedy)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    kw = dict(BASE)
    if kind == "v3":
        kw.update(q_lora_rank=20, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  rope_interleave=True)
        kw.update(overrides)
        return DeepseekV3Config(**kw)
    kw.update(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5, n_group=1, topk_group=1)
    if kind == "v2-group":
        kw.update(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    elif kind != "v2":
        raise ValueError(kind)
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def _init_(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights at a scale where activations stay O(1) and routing is not degenerate."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif "e_score_correction_bias" in name:
                v = 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif p.dim() >= 2:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1])
            else:
                v = 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(v.to(p.dtype))


def build_checkpoint(path: str | os.PathLike[str], kind: str = "v3", seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random float64 checkpoint (config.json + model.safetensors) to `path`."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    cfg = hf_config(kind, **overrides)
    return save_random(DeepseekV3ForCausalLM if kind == "v3" else DeepseekV2ForCausalLM, cfg, path, seed)


def save_random(cls: Any, cfg: Any, path: str | os.PathLike[str], seed: int) -> str:
    """transformers model `cls(cfg)` in float64 with `_init_`'s seeded weights, saved to `path`."""
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64)
    _init_(model, seed)
    path = os.fspath(path)
    model.save_pretrained(path)
    return path


def hf_reference(path: str | os.PathLike[str]):
    """transformers' model in float64 (eager experts: its fused kernels lack float64 on CPU; SDPA
    attention: the eager path takes the softmax in float32)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float64,
                                             experts_implementation="eager", attn_implementation="sdpa")
    return m.eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of the full sequence in one forward."""
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


# ---- a minimal splash driver (no scheduler): one rank, the local layout ------------------------------
@dataclass
class Seq:
    ids: list[int]
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    slot: int = -1  # a KDA hybrid's state slot (SimpleRunner assigns one on first use)


class SimpleRunner:
    """Runs splash's model over a KV pool with hand-built plans: prefill in chunks, decode, greedy."""

    def __init__(self, model, num_pages: int = 64, page_size: int = 4, layout=None) -> None:
        from splash.attention.local import LocalLayout
        from splash.kv.pool import KVPool

        cfg = model.cfg
        self.model, self.P = model, page_size
        self.pool = KVPool.for_model(cfg, num_pages, page_size, model.dtype, model.device)
        self.free = list(range(num_pages))[::-1]  # pop from the end; reversed so pages are out of order
        self.layout = layout or LocalLayout()
        from splash.kv.state import StatePool

        self.state = StatePool.for_model(cfg, 8, model.dtype, model.device)  # None unless a KDA hybrid
        self.slots = list(range(8))[::-1]

    def _slot(self, s: Seq) -> int:
        if self.state is not None and s.slot < 0:
            s.slot = self.slots.pop(0)
        return s.slot

    def step(self, work: list[tuple[Seq, int]]) -> torch.Tensor:
        """Run `num_new` new tokens of each seq (from seq.ids[cached:]); return last-row logits [B, V]."""
        from splash.step.plan import SeqSlice
        from splash.worker.context import build_context

        slices, ids = [], []
        for s, n in work:
            need = -(-(s.cached + n) // self.P)
            while len(s.pages) < need:
                s.pages.append(self.free.pop(0))
            slices.append(SeqSlice(req_id=id(s), start=s.cached, num_new=n, owner=0, pages=[list(s.pages)],
                                   sample=True, slot=self._slot(s)))
            ids.extend(s.ids[s.cached:s.cached + n])
        ctx = build_context(slices, kv=self.pool, layout=self.layout, page_size=self.P,
                                   state=self.state)
        hidden = self.model(torch.tensor(ids, device=self.model.device), ctx.positions, ctx)
        last = torch.tensor([sc.row_start + sc.num_new - 1 for sc in ctx.seqs], device=hidden.device)
        for s, n in work:
            s.cached += n
        return self.model.compute_logits(hidden[last])

    def all_logits(self, seq: Seq, n: int) -> torch.Tensor:
        """Logits of every row of one chunk (for prefill comparisons)."""
        from splash.step.plan import SeqSlice
        from splash.worker.context import build_context

        need = -(-(seq.cached + n) // self.P)
        while len(seq.pages) < need:
            seq.pages.append(self.free.pop(0))
        sl = SeqSlice(req_id=0, start=seq.cached, num_new=n, owner=0, pages=[list(seq.pages)], sample=True,
                      slot=self._slot(seq))
        ctx = build_context([sl], kv=self.pool, layout=self.layout, page_size=self.P, state=self.state)
        hidden = self.model(torch.tensor(seq.ids[seq.cached:seq.cached + n]), ctx.positions, ctx)
        seq.cached += n
        return self.model.compute_logits(hidden)


def add_mtp_layer(path: str | os.PathLike[str], seed: int = 0, noise: float = 0.5) -> str:
    """Give the checkpoint at `path` one MTP layer (DeepSeek-V3's names, layer num_hidden_layers): a copy
    of its last decoder layer with seeded noise, unit norms, a random eh_proj, the LM head and embedding
    as shared_head.head / embed_tokens; config.json gets num_nextn_predict_layers = 1. transformers
    ignores the layer (it warns about the extra tensors)."""
    import json

    from safetensors.torch import load_file, save_file

    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    p, last = f"model.layers.{n}", f"model.layers.{n - 1}."
    for k, t in list(w.items()):
        if k.startswith(last):
            if t.ndim > 1:
                t = t + noise * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)
            w[f"{p}." + k[len(last):]] = t.clone()
    d = cfg["hidden_size"]
    one = torch.ones(d, dtype=w["model.norm.weight"].dtype)
    w.update({f"{p}.enorm.weight": one.clone(), f"{p}.hnorm.weight": one.clone(),
              f"{p}.shared_head.norm.weight": one.clone(),
              f"{p}.eh_proj.weight": torch.randn(d, 2 * d, generator=g, dtype=one.dtype) / (2 * d) ** 0.5,
              f"{p}.embed_tokens.weight": w["model.embed_tokens.weight"].clone(),
              f"{p}.shared_head.head.weight": w.get("lm_head.weight", w["model.embed_tokens.weight"]).clone(),
              })
    save_file(w, file, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def serve_requests(eng, prompts, params, abort: tuple[int, int] | None = None) -> dict:
    """{prompt index: final CompletionOutput} of `prompts` served to the end (aborting request abort[1]
    at step abort[0]), the books proved after every step."""
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=params)
    done = {}
    while eng.has_unfinished():
        if abort is not None and eng.steps == abort[0]:
            done[abort[1]] = eng.abort(str(abort[1])).outputs[0]
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0]
        assert not eng.scheduler.book_errors()
    return dict(sorted(done.items()))
