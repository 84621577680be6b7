"""Which form an MLA chunk is attended in: absorbed (over the latent) or MHA (decompressed keys).

One rule for the runtime (splash/attention/mha.py applies it per chunk) and the cost model (CP splits
the rows of the chunks that take the MHA form over its ranks, DOP runs them TP-style:
`costmodel.spread_chunks`)."""

from __future__ import annotations

import numpy as np


def chunk_costs(rows: int, ctx: int, heads: int, d_c: int, d_r: int, d_nope: int, d_v: int
                ) -> tuple[int, int]:
    """(absorbed, mha) multiply-adds of attending `rows` query rows over `ctx` keys for `heads` heads.

    absorbed: scores and values over the latent, plus absorbing W_UK into q and W_UV into the output;
    mha: decompressing the keys and values for every head, plus scores and values in head space."""
    absorbed = rows * ctx * heads * (d_c + d_r + d_c) + rows * heads * 2 * d_nope * d_c
    mha = ctx * heads * (d_nope + d_v) * d_c + rows * ctx * heads * (d_nope + d_r + d_v)
    return absorbed, mha


def mha_cheaper(rows: np.ndarray | int, ctx: np.ndarray | int, d_c: int, d_r: int, d_nope: int, d_v: int
                ) -> np.ndarray:
    """Whether chunks of `rows` new rows over `ctx` keys (whole contexts) take the MHA form: more than
    one row, and fewer multiply-adds decompressed than absorbed (elementwise over arrays)."""
    q, s = np.asarray(rows), np.asarray(ctx)
    absorbed, mha = chunk_costs(q, s, 1, d_c, d_r, d_nope, d_v)
    return (q > 1) & (mha < absorbed)
