"""The DSA selection rule in isolation: top-k by (score descending, position ascending), and CP's merge
of every rank's local candidates equals the single-rank selection, exact ties (ReLU zeros) included."""

from __future__ import annotations

import pytest
import torch

from splash.attention.cp import merge_candidates
from splash.attention.sparse import index_scores, top_keys


def _rule(scores: torch.Tensor, k: int) -> list[list[int]]:
    """The rule written out: sort (−score, position) pairs, keep the first k visible ones."""
    out = []
    for row in scores.tolist():
        pairs = sorted((-s, p) for p, s in enumerate(row) if s != float("-inf"))
        out.append(sorted(p for _, p in pairs[:k]))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_merge_of_local_candidates_is_the_global_top_k(world):
    g = torch.Generator().manual_seed(world)
    n, m, k, P = 9, 53, 8, 4
    # few distinct values: ties everywhere, zeros the commonest (as ReLU makes them)
    scores = torch.randint(-2, 3, (n, m), generator=g).double().clamp(min=-1.0) * 0.5
    scores[scores < 0] = 0.0
    for t in range(n):  # causal: row t sees keys 0 .. 5 t
        scores[t, 5 * t + 1:] = float("-inf")
    want = _rule(scores, k)
    best, col = top_keys(scores, k)
    kept = [sorted(c for c, b in zip(cs, bs) if b != float("-inf"))
            for cs, bs in zip(col.tolist(), best.tolist())]
    assert kept == want
    pos = torch.arange(m)
    cands_s, cands_p = [], []
    for r in range(world):  # CP: page j on rank j % T
        mine = pos[(pos // P) % world == r]
        b, c = top_keys(scores[:, mine], k)
        cands_s.append(b)
        cands_p.append(mine[c].masked_fill(torch.isinf(b), -1))
    got = merge_candidates(torch.stack(cands_s), torch.stack(cands_p), k)
    assert [sorted(p for p in row if p >= 0) for row in got.tolist()] == want


def test_index_scores_are_relu_weighted_head_sums():
    g = torch.Generator().manual_seed(0)
    q, w, keys = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 4, 6), (3, 4), (7, 6)))
    want = torch.einsum("nh,nhm->nm", w, torch.relu(torch.einsum("nhd,md->nhm", q, keys)))
    assert torch.allclose(index_scores(q, w, keys), want, atol=1e-14, rtol=0)
