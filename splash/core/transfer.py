"""A switch priced per layer without listing pages or blocks: the closed forms the policy and the
simulator evaluate every step (Eq 7's per-layer bytes).

The same holdings as the manifests list (`splash.core.holdings`: NONE < PART < ALL on each rank), only
counted: a rank receives what it holds after minus what it holds in both layouts (the smaller holding),
and frees what it held minus that. The tests check every count against `Manifest`'s listed blocks. The
weights' bytes are the manifest's own (head runs, FP8 block scales), computed once per (src, dst, T).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splash.core.holdings import ALL, PART, holding, position_tokens_matrix
from splash.core.layouts import DEFAULT_PAGE_SIZE, Layout
from splash.core.manifest import Manifest
from splash.core.sizes import AttentionSizes


def _owner_arrays(owners_src: Sequence[int],
                  owners_dst: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
    oa = np.asarray(owners_src, dtype=np.int64).reshape(-1)
    return oa, oa if owners_dst is None else np.asarray(owners_dst, dtype=np.int64).reshape(-1)


def kv_transfer_tokens(src: Layout, dst: Layout, contexts: Sequence[int], owners_src: Sequence[int],
                       owners_dst: Sequence[int] | None, ranks: int,
                       page_size: int | None = DEFAULT_PAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(received, freed) tokens per rank for one layer's KV, without listing pages.

    Same answer as `Manifest.kv` (the tests check it): a rank receives what the destination
    gives it minus what it already holds, and frees what it held minus what it keeps.
    """
    s = np.asarray(contexts, dtype=np.int64).reshape(-1)
    oa, ob = _owner_arrays(owners_src, owners_dst)
    a, b = holding(src.ownership, oa, ranks), holding(dst.ownership, ob, ranks)
    split_a, split_b = a == PART, b == PART
    cp = position_tokens_matrix(s, ranks, page_size) if split_a.any() or split_b.any() else None

    def tokens(h: np.ndarray, split: np.ndarray) -> np.ndarray:
        """[T, B] tokens held: the context if ALL, the PART's pages' tokens, or none."""
        if cp is not None and split.all():
            return cp
        whole = np.where(h == ALL, s[None, :], 0)
        return whole if cp is None else np.where(split, cp, whole)

    held_a, held_b = tokens(a, split_a), tokens(b, split_b)
    kept = np.minimum(held_a, held_b)  # (nested holdings: the smaller one is what both hold)
    return (held_b - kept).sum(axis=1), (held_a - kept).sum(axis=1)


def state_transfer_requests(src: Layout, dst: Layout, owners_src: Sequence[int],
                            owners_dst: Sequence[int] | None, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(received, freed) request states per rank for one KDA layer (a fraction 1/T per head slice),
    without listing blocks: the closed form of `Manifest.state`."""
    oa, ob = _owner_arrays(owners_src, owners_dst)
    a = holding(src.state_placement, oa, ranks)
    b = holding(dst.state_placement, ob, ranks)
    share = np.array([0.0, 1.0 / ranks, 1.0])  # g of NONE, PART (a head slice), ALL
    held_a, held_b = share[a], share[b]
    kept = np.minimum(held_a, held_b)
    return (held_b - kept).sum(axis=1), (held_a - kept).sum(axis=1)


def weight_transfer_bytes(sizes: AttentionSizes, src: Layout, dst: Layout, ranks: int) -> np.ndarray:
    """Per-rank bytes of one layer's projections a switch src -> dst receives."""
    recv = sizes.memo(("w_recv", src, dst, ranks),
                      lambda: Manifest(sizes, src, dst, ranks, 1, ()).weights.recv_bytes)
    return np.asarray(recv)


def switch_layer_bytes(sizes: AttentionSizes, src: Layout, dst: Layout, contexts: Sequence[int],
                       owners_src: Sequence[int], owners_dst: Sequence[int] | None, ranks: int,
                       page_size: int | None = DEFAULT_PAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """([layers, T] weight bytes, [layers, T] KV + state bytes) each rank receives per layer in a switch
    src -> dst (closed forms, what the policy and the simulator price by Eq 7): an MLA layer's
    projections and latent pages, a hybrid's KDA layer's projections and per-request states."""
    w_mla = weight_transfer_bytes(sizes, src, dst, ranks)
    kv_tok, _ = kv_transfer_tokens(src, dst, contexts, owners_src, owners_dst, ranks, page_size)
    w = np.tile(w_mla, (sizes.layers, 1))
    kv = np.outer(sizes.kv_layer_bytes, kv_tok)
    if sizes.cfg.is_hybrid:
        w_kda = np.asarray(sizes.memo(("kda_w_recv", src, dst, ranks),
                                      lambda: Manifest(sizes, src, dst, ranks, 1, ()).kda_weights.recv_bytes))
        st, _ = state_transfer_requests(src, dst, owners_src, owners_dst, ranks)
        kda = list(sizes.kda_layers)
        w[kda] = w_kda
        kv[kda] = st * sizes.state_layer_bytes
    return w, kv
