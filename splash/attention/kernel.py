"""The absorbed-MLA attention kernel shared by every layout (see docs/runtime.md).

Scores are `scale * (q_lat . c_kv + q_pe . k_pe)`, one matmul per call against the latent keys; the
softmax is causal by *position* (a row at position p sees keys with position <= p), so the same call
serves a full history (TP/DP), a rank's shard of it (CP) and mixed prefill/decode rows. It returns the
natural-log log-sum-exp so partial results over disjoint key sets combine exactly with `merge`.
Low-precision dtypes (bf16/fp16) take the softmax in float32.
"""

from __future__ import annotations

import torch

from splash.kv.pool import key_slots

__all__ = ["acc_dtype", "attend", "gather_keys", "key_slots", "merge"]


def gather_keys(pool_layer: torch.Tensor, pages: torch.Tensor, ctx_len: int, page_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [m, D] this rank holds for a request (pages as in `key_slots`) and their positions [m]."""
    slots, pos = key_slots(pages, ctx_len, page_size)
    return pool_layer.reshape(-1, pool_layer.shape[-1])[slots], pos


def attend(q_lat: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
           q_pos: torch.Tensor, scale: float, *, lse: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q_lat [n, h, d_c], q_pe [n, h, d_r] against keys [m, d_c + d_r] -> (out [n, h, d_c], lse [n, h]).

    A row with no visible key gets out 0 and lse -inf. `lse=False` skips the log-sum-exp (None is
    returned in its place): only a merge of partial results (CP) needs it, and it costs a reduction
    over the scores as large as the softmax's."""
    n, h, d_c = q_lat.shape
    acc = acc_dtype(q_lat.dtype)
    if keys.shape[0] == 0:
        none = torch.full((n, h), float("-inf"), device=q_lat.device, dtype=acc) if lse else None
        return q_lat.new_zeros(n, h, d_c), none
    s = torch.matmul(torch.cat([q_lat, q_pe], dim=-1), keys.t()).to(acc)  # [n, h, m]
    s.mul_(scale)
    s.masked_fill_((key_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))  # causal by position
    total = torch.logsumexp(s, dim=-1) if lse else None
    p = torch.softmax(s, dim=-1)  # NaN on rows that see no key: zeroed below (no host sync needed)
    out = torch.nan_to_num(torch.matmul(p.to(keys.dtype), keys[:, :d_c]), nan=0.0)
    return out, total


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact combination of partial attentions over disjoint key sets (outs [n, h, d], lses [n, h])."""
    if len(outs) == 1:
        return outs[0]
    lse = torch.stack(lses)  # [k, n, h]
    total = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - torch.where(torch.isinf(total), torch.zeros_like(total), total))  # 0 where lse=-inf
    w = torch.nan_to_num(w, nan=0.0)
    return sum(o * wi[..., None].to(o.dtype) for o, wi in zip(outs, w))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax and log-sum-exp are kept in: float32 for bf16/fp16, else the input's."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
