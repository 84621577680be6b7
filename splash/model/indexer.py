"""The DSA lightning indexer of one layer (DeepSeek-V3.2, GLM-5): which keys each query's MLA reads.

Per token (SPEC §9): queries `q_I = wq_b(c_q)` [N, H_I, d_I] from the query latent, one head-free key
`k_I = LayerNorm(wk(x))` [N, d_I] (cached per token, paged with the latent: the pool's "index_k"
store), rotary on the first d_r dims of both (V3.2 half-split, GLM-5 interleaved) and per-head weights
`w = weights_proj(x) * H_I^-1/2`. Then I[t, s] = sum_h w[t, h] ReLU(q_I[t, h] . k_I[s] * d_I^-1/2) over
the keys s <= t, and query t attends its top-`index_topk` keys (splash/attention/sparse.py).

The projections are small and replicated on every rank in every layout (both peers replicate them
under TP too), so no layout needs a reduction of index scores and a switch never moves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splash.core.model_config import ModelConfig
from splash.model import gemm
from splash.model.loader import CheckpointReader
from splash.model.rope import Rotary


@dataclass
class IndexRows:
    """One layer's indexer inputs for every row of a step (replicated on every rank)."""

    q: torch.Tensor  # [N, H_I, d_I] roped queries, in the score dtype
    w: torch.Tensor  # [N, H_I] head weights (weights_proj(x) * H_I^-1/2 * d_I^-1/2), in the score dtype
    k_new: torch.Tensor  # [N, d_I] roped keys of the step's rows, in the model dtype (cached)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Index scores in float32 as the reference computes them, float64 for a float64 model (so every
    layout, whatever its matmul shapes, ranks the keys alike to ~1e-16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not cfg.q_lora_rank:
            raise ValueError("the DSA indexer reads the query latent: q_lora_rank must be set")
        self.rotary = rotary
        self.n_heads, self.head_dim, self.d_rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.style = "interleave" if cfg.index_rope_interleave else "half"
        # ReLU(a * s) = s * ReLU(a) for s > 0: the key scale folds into the head weights.
        self.w_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5
        d = cfg.hidden_size
        for name, shape in (("wq_b", (self.n_heads * self.head_dim, cfg.q_lora_rank)),
                            ("wk", (self.head_dim, d)), ("k_norm_w", (self.head_dim,)),
                            ("k_norm_b", (self.head_dim,))):
            self.register_buffer(name, torch.empty(*shape, dtype=dtype, device=device))
        # kept in float32 for bf16 models, as transformers keeps it (`_keep_in_fp32_modules`)
        self.register_buffer("weights_proj",
                             torch.empty(self.n_heads, d, dtype=score_dtype(dtype), device=device))

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        dt = self.wk.dtype
        self.wq_b = reader.get(f"{prefix}.wq_b.weight", dt, dev)
        self.wk = reader.get(f"{prefix}.wk.weight", dt, dev)
        self.k_norm_w = reader.get(f"{prefix}.k_norm.weight", dt, dev)
        self.k_norm_b = reader.get(f"{prefix}.k_norm.bias", dt, dev)
        self.weights_proj = reader.get(f"{prefix}.weights_proj.weight", self.weights_proj.dtype, dev)

    def prepare(self, x: torch.Tensor, q_in: torch.Tensor, positions: torch.Tensor,
                scoring: tuple[torch.Tensor, torch.Tensor] | None = None) -> IndexRows:
        """x [N, d] (the layer's normed input), q_in [N, q_lora] (the normed query latent) -> IndexRows.
        `scoring`: (rows, their positions) whose queries this rank scores (the layout's
        `index_rows`: CP's share of a split chunk); the other rows' q and w are left unset. None: all."""
        b, rot, r = self._buffers, self.rotary, self.d_rope
        tables = rot.tables(positions)
        k = F.layer_norm(gemm.linear(x, b["wk"]), (self.head_dim,), b["k_norm_w"], b["k_norm_b"], 1e-6)
        k = torch.cat([rot.apply(k[:, :r], tables, self.style), k[:, r:]], dim=-1)
        sd = score_dtype(x.dtype)
        if scoring is None:
            q, w = self._queries(x, q_in, tables, sd)
            return IndexRows(q=q, w=w, k_new=k)
        rows, pos = scoring
        q_s, w_s = self._queries(x[rows], q_in[rows], rot.tables(pos), sd)
        q = q_s.new_empty(x.shape[0], *q_s.shape[1:])
        w = w_s.new_empty(x.shape[0], *w_s.shape[1:])
        q[rows], w[rows] = q_s, w_s
        return IndexRows(q=q, w=w, k_new=k)

    def _queries(self, x: torch.Tensor, q_in: torch.Tensor, tables: object, sd: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped queries [n, H_I, d_I] and head weights [n, H_I] of rows x / q_in, in the score dtype."""
        b, rot, r = self._buffers, self.rotary, self.d_rope
        q = gemm.linear(q_in, b["wq_b"]).view(x.shape[0], self.n_heads, self.head_dim)
        q = torch.cat([rot.apply(q[..., :r], tables, self.style), q[..., r:]], dim=-1)
        return q.to(sd), F.linear(x.to(sd), b["weights_proj"]) * self.w_scale
