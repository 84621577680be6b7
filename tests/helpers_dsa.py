"""Test fixtures for DeepSeek Sparse Attention (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`): tiny
random float64 checkpoints built with transformers, the float64 reference, and what its lightning indexer
selected (`hf_topk`) and scored (`reference_scores`) per layer.

Mirrors helpers_ckpt.py (same BASE dims, same `_init_`); import as `from helpers_dsa import ...`.

What the transformers 5.24 references do (read from modeling_deepseek_v32.py / modeling_glm_moe_dsa.py):
- Indexer per layer (`self_attn.indexer`): q = wq_b(q_resid) with q_resid = q_a_layernorm(q_a_proj(x)) (the
  main attention's query latent, x = the layer's input_layernorm output) as index_n_heads heads of
  index_head_dim; k = k_norm(wk(x)), ONE head, k_norm a LayerNorm (eps 1e-6, with bias; not RMSNorm).
  The rotary goes on the FIRST qk_rope_head_dim dims of each head (rot, then pass), with the main
  attention's cos/sin (positions from 0); V3.2 rotates half-split (rotate_half), GLM-5 interleaved pairs.
  The main MLA rotary is interleaved in both.
- score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * index_head_dim**-0.5), w = weights_proj(x) *
  index_n_heads**-0.5: the scale is applied before the ReLU. The q.k products and the head sum are done in
  float32 (`q.float() @ k.float()`), even in a float64 model; q, k, the LayerNorm and the rotary are float64
  (but cos/sin were computed in float32 and cast). weights_proj is listed in `_keep_in_fp32_modules`, which
  does not apply at float64: it stays float64 and its output is cast to float32.
- Mask: with sdpa the indexer gets the boolean causal mask [B, S, T] (created even where sdpa could skip
  it) and sets future keys to -inf; top-k takes k = min(index_topk, T) over the whole row, so rows with
  t + 1 < index_topk "select" some masked future keys too (harmless: the causal mask removes them).
  `hf_topk` drops those, so each set has min(index_topk, t + 1) positions <= t.
- The indices are scattered into a boolean mask that is and-ed into the causal mask; the main attention
  is then ordinary (dense) sdpa over the selected keys. Attention implementations: "eager" (softmax in
  float32) and "sdpa" only (no flash / flex); we use sdpa so the softmax stays float64.
- GLM-5: a "shared" layer has no indexer module (no weights) and reuses the previous full layer's top-k
  indices; layer 0 must be "full".

Sparsity and ties, measured with `tie_stats()` (run this file): seeds 0-4, each kind, 40 prompts each of
20-40 random ids in [3, 97), one full-sequence forward, every indexer layer. Every selection is genuinely
sparse: 8 of up to 40 keys, and not a sliding window. Of the rows with a top-k boundary (t + 1 > 8):
  v32: 12,984 rows, 10 exact ties (0.08%), 13 with a relative gap < 1e-5; 13 of 200 prompts hold such a row;
  glm:  8,656 rows,  2 exact ties (0.02%),  6 with a gap < 1e-5;  6 of 200 prompts.
Every exact tie was between two scores of exactly 0: a key where all 8 heads' q.k <= 0 scores 0 after
the ReLU (0.4% of (query, key) pairs, ~1/2**8); since weights_proj can be negative, 0 sits mid-ranking
and two such keys can straddle the boundary. No tie between nonzero scores was seen; `reference_scores`'
top-k reproduced `hf_topk` on every row (torch.topk breaks those zero ties the same way both times). The
built-in tiny-dsa / tiny-glm5 (top-k 16, 30-60 token prompts) look the same: ~0.1% exact zero ties.
So a test comparing selections should skip `near_tie_rows(model, ids)` or use prompts without any.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

try:
    from helpers_ckpt import BASE, _init_, hf_greedy, hf_logits, hf_reference, save_random  # noqa: F401
except ImportError:  # imported as tests.helpers_dsa
    from tests.helpers_ckpt import BASE, _init_, hf_greedy, hf_logits, hf_reference, save_random  # noqa: F401

# BASE (helpers_ckpt: d_rope = 32, 32 experts so the float32 router has no scalar tail) plus V3's q_lora and
# grouped noaux_tc routing, and an indexer: index_head_dim must be >= qk_rope_head_dim (the indexer rotates
# its first qk_rope_head_dim dims); index_topk = 8 is well below the 20-40 token prompts tests use.
DSA: dict[str, Any] = dict(q_lora_rank=20, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True, index_topk=8, index_head_dim=32, index_n_heads=8)


def hf_dsa_config(kind: str = "v32", **overrides: Any):
    """A transformers config: kind "v32" (DeepseekV32Config, an indexer in every layer) or "glm"
    (GlmMoeDsaConfig; indexer_types alternate full / shared, ["full", "shared", "full"] for BASE's 3
    layers, unless overridden)."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    kw = {**BASE, **DSA, **overrides}
    if kind == "glm":
        n = kw["num_hidden_layers"]
        kw.setdefault("indexer_types", ["full" if i % 2 == 0 else "shared" for i in range(n)])
        return GlmMoeDsaConfig(**kw)
    if kind != "v32":
        raise ValueError(kind)
    return DeepseekV32Config(**kw)


def build_dsa_checkpoint(path: str | os.PathLike[str], kind: str = "v32", seed: int = 0,
                         **overrides: Any) -> str:
    """Write a tiny random float64 DSA checkpoint (config.json + model.safetensors) to `path`. Weights as
    helpers_ckpt._init_: projections (the indexer's wq_b, wk, weights_proj too) N(0, 1/fan_in), norms
    1 + 0.1 N (the indexer's LayerNorm k_norm weight too), 1-D tensors 0.1 N (k_norm's bias)."""
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    cls = GlmMoeDsaForCausalLM if kind == "glm" else DeepseekV32ForCausalLM
    return save_random(cls, hf_dsa_config(kind, **overrides), path, seed)


def hf_dsa_reference(path: str | os.PathLike[str]):
    """transformers' DSA model in float64, loaded as helpers_ckpt.hf_reference loads every model (eager
    experts, sdpa attention: flash / flex are not supported by these models). The indexer runs in both
    attention paths; with eager / sdpa its top-k becomes part of the attention mask."""
    return hf_reference(path)


def _layer_types(model) -> list[str]:
    n = model.config.num_hidden_layers
    return list(getattr(model.config, "indexer_types", None) or ["full"] * n)


def _indexers(model) -> dict[int, torch.nn.Module]:
    return {i: layer.self_attn.indexer for i, layer in enumerate(model.model.layers)
            if getattr(layer.self_attn, "indexer", None) is not None}


def _share(model, per_full: dict[int, Any]) -> dict[int, Any]:
    """Every layer's entry: a full layer's own, a shared layer the previous full layer's."""
    out, last = {}, None
    for i, t in enumerate(_layer_types(model)):
        if t == "full":
            last = per_full[i]
        out[i] = last
    return out


@torch.no_grad()
def _run_hooked(model, ids: list[int], pre: bool):
    """One full-sequence forward (no cache); per full layer the indexer's (args, kwargs) or its output."""
    got: dict[int, Any] = {}
    handles = []
    for i, ix in _indexers(model).items():
        if pre:
            def hook(mod, args, kwargs, i=i):
                got[i] = (args, kwargs)
            handles.append(ix.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            def hook(mod, args, out, i=i):
                got[i] = out.detach().clone()
            handles.append(ix.register_forward_hook(hook))
    try:
        model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


@torch.no_grad()
def hf_topk(model, ids: list[int]) -> dict[int, list[frozenset[int]]]:
    """{layer: [keys selected by query t, for t in range(len(ids))]} from one full-sequence forward: every
    layer (a GLM "shared" layer gets the previous full layer's sets). The reference's top-k rows also
    hold masked future keys where t + 1 < index_topk; those are dropped, so set t has
    min(index_topk, t + 1) positions, all <= t."""
    raw = _run_hooked(model, ids, pre=False)
    sets = {i: [frozenset(j for j in row.tolist() if j <= t) for t, row in enumerate(idx[0])]
            for i, idx in raw.items()}
    return _share(model, sets)


def _rotary(indexer):
    mod = sys.modules[type(indexer).__module__]
    if type(indexer).__name__.startswith("GlmMoeDsa"):
        return mod.apply_rotary_pos_emb_interleave  # GLM-5's indexer: interleaved pairs
    return mod.apply_rotary_pos_emb  # V3.2's: half-split


def index_scores(ix, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                 cache=None) -> torch.Tensor:
    """The reference indexer's index_scores [B, S, T], float32, recomputed op for op from its inputs (the
    forward minus the top-k); masked keys are -inf. (The reference adds a float mask instead when
    attention is eager, which promotes to the mask's dtype; with sdpa the mask is boolean, as here.)"""
    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    r = ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [r, ix.head_dim - r], dim=-1)
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [r, ix.head_dim - r], dim=-1)
    q_rot, k_rot = _rotary(ix)(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        raise ValueError("index_scores recomputes a cache-free forward only")
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale
    scores = torch.nn.functional.relu(scores)
    w = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads ** -0.5)
    out = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        return out.masked_fill(~attention_mask, float("-inf"))
    return out.masked_fill(attention_mask < 0, float("-inf"))


@torch.no_grad()
def reference_scores(model, ids: list[int]) -> dict[int, torch.Tensor]:
    """{layer: [len(ids), len(ids)] float32 index scores} (query row, key column; -inf above the diagonal)
    from one full-sequence forward, recomputed from each indexer's hooked inputs exactly as the reference
    computes them; a GLM "shared" layer gets the previous full layer's (the scores its top-k came from)."""
    raw = _run_hooked(model, ids, pre=True)
    ix = _indexers(model)
    scores = {i: index_scores(ix[i], *args, **kwargs)[0] for i, (args, kwargs) in raw.items()}
    return _share(model, scores)


def boundary_gaps(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per query row of a [S, T] score matrix: (k-th best - (k+1)-th best valid score) / max |score| of
    the row, NaN where the row has <= topk valid keys (no boundary). 0 = an exact tie at the boundary."""
    S = scores.shape[0]
    gaps = torch.full((S,), float("nan"), dtype=torch.float64)
    for t in range(S):
        row = scores[t][torch.isfinite(scores[t])].double()
        if row.numel() <= topk:
            continue
        top = row.topk(topk + 1).values
        gaps[t] = (top[topk - 1] - top[topk]) / row.abs().max().clamp_min(1e-30)
    return gaps


def near_tie_rows(model, ids: list[int], tol: float = 1e-5) -> dict[int, set[int]]:
    """{layer: query rows whose top-k boundary gap (see boundary_gaps) is under `tol`}: rows where a
    comparison of selected sets is not meaningful (an exact tie, or one that float32 rounding may flip)."""
    topk = model.config.index_topk
    out = {}
    for i, sc in reference_scores(model, ids).items():
        gaps = boundary_gaps(sc, topk)
        out[i] = {t for t in range(len(ids)) if gaps[t] < tol}
    return out


def tie_stats(kinds=("v32", "glm"), seeds=range(5), prompts: int = 40, lo: int = 20, hi: int = 40,
              tmp: str | None = None) -> dict[str, Any]:
    """Measure how sparse and how tie-free the selections are (the numbers in this module's docstring):
    rows with a boundary, exact ties (gap 0; zero_ties: those between two ReLU-zero scores), near ties
    (gap < 1e-5) and the prompts holding one, exact-zero scores among valid keys, and whether
    `reference_scores`' top-k reproduces `hf_topk`. About 15 s a kind for the defaults."""
    import tempfile

    tmp = tmp or tempfile.mkdtemp(prefix="splash_dsa_ties-")
    stats = dict(rows=0, boundary_rows=0, exact_ties=0, zero_ties=0, near_ties=0, zero_scores=0,
                 valid_scores=0, mismatched_sets=0, min_gap=float("inf"), prompts=0, near_tie_prompts=0)
    for kind in kinds:
        for seed in seeds:
            path = build_dsa_checkpoint(os.path.join(tmp, f"{kind}-{seed}"), kind=kind, seed=seed)
            model = hf_dsa_reference(path)
            topk = model.config.index_topk
            g = torch.Generator().manual_seed(1000 + seed)
            for _ in range(prompts):
                n = int(torch.randint(lo, hi + 1, (1,), generator=g))
                ids = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
                sel, sc = hf_topk(model, ids), reference_scores(model, ids)
                stats["prompts"] += 1
                near = 0
                for i in sorted(_indexers(model)):
                    s = sc[i]
                    valid = torch.isfinite(s)
                    stats["rows"] += n
                    stats["zero_scores"] += int((s[valid] == 0).sum())
                    stats["valid_scores"] += int(valid.sum())
                    gaps = boundary_gaps(s, topk)
                    b = gaps[~gaps.isnan()]
                    stats["boundary_rows"] += int(b.numel())
                    stats["exact_ties"] += int((b == 0).sum())
                    for t in (gaps == 0).nonzero().flatten().tolist():  # a tie of two ReLU zeros?
                        stats["zero_ties"] += int(s[t][torch.isfinite(s[t])].topk(topk).values[-1] == 0)
                    stats["near_ties"] += int((b < 1e-5).sum())
                    near += int((b < 1e-5).sum())
                    if b.numel():
                        stats["min_gap"] = min(stats["min_gap"], float(b.min()))
                    for t in range(n):
                        k = min(topk, t + 1)
                        mine = frozenset(s[t].topk(k).indices.tolist())
                        stats["mismatched_sets"] += int(mine != sel[i][t])
                stats["near_tie_prompts"] += int(near > 0)
    return stats


if __name__ == "__main__":
    torch.set_num_threads(1)
    for kind in ("v32", "glm"):
        print(kind, tie_stats(kinds=(kind,)))
