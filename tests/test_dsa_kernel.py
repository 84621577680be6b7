"""The native DSA index top-k (csrc/dsa_index.c through native.index_topk) against the torch path.

Both run `sparse.local_candidates`' rule: row t scores every held key s at a position <= its own,
I = sum_h w ReLU(q_h . k_s), and keeps the top k by (score descending, position ascending). Checked on
float64, float32 and bf16 pools: the selected keys (positions and local slots) are identical and the
scores agree (float64 to 1e-12 of the row's scale); rows seeing fewer keys than k, k >= every context,
pages not held (-1, CP's shards), exact zero ties (ReLU), no rows, many tables and rows in one call
over several threads and waves; CP's merge of native candidates equals the one-rank selection; the
switches that pin the torch path. The native path lists a row's keys in position order, the torch
path by score, so rows are compared in position order.
"""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import pytest
import torch

from splash.attention import native, sparse
from splash.attention.cp import CPLayout
from splash.attention.kernels import Kernels
from splash.config import KernelConfig
from splash.kv.pool import KVPool
from splash.model.context import SliceCtx
from splash.model.indexer import IndexRows

pytestmark = pytest.mark.skipif(native.dsa_library() is None, reason="no C compiler: no native kernel")

DTYPES = [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]
IDS = ["f64", "f32", "bf16"]


def _pool(P: int, pages: int, d: int, dtype: torch.dtype, keys: torch.Tensor | None = None,
          seed: int = 0) -> KVPool:
    kv = KVPool(1, pages, P, 4, dtype=dtype, extra={"index_k": ((0,), d)})
    g = torch.Generator().manual_seed(seed)
    kv.extra["index_k"].copy_(keys if keys is not None else torch.randn(1, pages, P, d, generator=g))
    return kv


def _rows(N: int, H: int, d: int, dtype: torch.dtype, seed: int = 1, q_sign: int = 0) -> IndexRows:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, d, generator=g, dtype=torch.float64)
    if q_sign:
        q = q.abs() * q_sign
    w = torch.randn(N, H, generator=g, dtype=torch.float64)
    return IndexRows(q=q.to(dtype), w=w.to(dtype), k_new=torch.zeros(N, d))


def _candidates(kernel: str, monkeypatch, kv: KVPool, table: torch.Tensor, start: int, num_new: int,
                rows: IndexRows, k: int, row_start: int = 0):
    """local_candidates for one slice (rows [row_start, row_start + num_new) at positions from `start`)
    through `kernel` ("native" | "torch")."""
    s = SliceCtx(0, start, num_new, 0, False, row_start, pages=table, page_size=kv.page_size)
    N = rows.q.shape[0]
    positions = torch.zeros(N, dtype=torch.long)
    positions[row_start:row_start + num_new] = torch.arange(start, start + num_new)
    ctx = SimpleNamespace(kv=kv, positions=positions, sparse=_pinned(kernel))
    q_rows = torch.arange(row_start, row_start + num_new)
    assert ctx.sparse.kernels.index_kernel(rows.q, kv.store_flat("index_k", 0)) == kernel
    return sparse.local_candidates(0, s, rows, q_rows, ctx, k)


def _pinned(kernel: str) -> SimpleNamespace:
    """A step's sparse state whose kernels are pinned to `kernel` (--attention-kernel, SPLASH_ATTN_KERNEL)."""
    return SimpleNamespace(kernels=Kernels(KernelConfig(attention_kernel=kernel)))


def _by_position(sc: torch.Tensor, ps: torch.Tensor, sl: torch.Tensor):
    """Each row's entries in position order, padding (-1) last."""
    order = torch.where(ps < 0, torch.iinfo(torch.long).max, ps).argsort(dim=1, stable=True)
    return sc.gather(1, order), ps.gather(1, order), sl.gather(1, order)


def _near_ties(kv: KVPool, table: torch.Tensor, rows: IndexRows, q_rows: torch.Tensor,
               positions: torch.Tensor, k: int) -> set[int]:
    """Rows whose k-th and (k+1)-th best torch scores differ, but by less than float32 rounding can
    reorder (an exact tie is decided by position on both paths alike)."""
    from splash.attention.kernel import key_slots

    P = kv.page_size
    slots, pos = key_slots(table, int(positions.max()) + 1, P)
    if pos.numel() <= k:
        return set()
    sc = sparse.index_scores(rows.q[q_rows].double(), rows.w[q_rows].double(),
                             kv.store_flat("index_k", 0)[slots].double())
    sc.masked_fill_(pos[None, :] > positions[:, None], float("-inf"))
    top = torch.sort(sc, dim=1, descending=True).values
    gap = (top[:, k - 1] - top[:, k]).abs()
    scale = top[:, k - 1].abs().clamp(min=1e-3)
    return {i for i in range(len(q_rows)) if 0 < gap[i] < 1e-5 * scale[i]}


def _check(a, b, exact: bool, skip: set[int] = frozenset()) -> None:
    """a: torch path, b: native path, as (scores, positions, slots)."""
    a, b = _by_position(*a), _by_position(*b)
    keep = [i for i in range(a[0].shape[0]) if i not in skip]
    assert len(keep) >= a[0].shape[0] - max(1, a[0].shape[0] // 10), "too many near ties to check"
    for x, y in zip(a[1:], b[1:]):
        assert torch.equal(x[keep], y[keep]), "selections differ"
    sa, sb = a[0][keep], b[0][keep]
    assert torch.equal(torch.isinf(sa), torch.isinf(sb))
    fin = torch.isfinite(sa)
    if fin.any():
        scale = sa.masked_fill(~fin, 0).abs().amax(dim=1, keepdim=True).clamp(min=1.0).expand_as(sa)
        err = ((sa - sb).abs() / scale)[fin].max().item()
        assert err < (1e-12 if exact else 1e-5), err


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("H,d,P,pages,start,num_new,k", [
    (8, 48, 4, 20, 0, 40, 8),  # a prefill: early rows see fewer keys than k
    (3, 16, 16, 12, 150, 30, 40),  # a chunk past the start; H not a multiple of the vector width
    (12, 32, 8, 40, 300, 1, 100),  # one decode row
    (8, 128, 16, 24, 0, 7, 2048),  # k >= every context: every key, padded
    (64, 128, 16, 160, 2500, 3, 2048),  # V3.2's heads, a long decode context
])
def test_matches_torch_path(monkeypatch, dt, H, d, P, pages, start, num_new, k):
    sdt, pdt = dt
    g = torch.Generator().manual_seed(H * 7 + d)
    need = (start + num_new + P - 1) // P
    table = torch.randperm(pages, generator=g)[:need]
    table[torch.rand(need, generator=g) < 0.25] = -1  # pages another rank holds
    kv = _pool(P, pages, d, pdt, seed=d)
    rows = _rows(num_new + 3, H, d, sdt, seed=H)
    a = _candidates("torch", monkeypatch, kv, table, start, num_new, rows, k, row_start=2)
    b = _candidates("native", monkeypatch, kv, table, start, num_new, rows, k, row_start=2)
    assert b[0].dtype == sdt and b[1].shape == (num_new, k)
    skip = set() if sdt == torch.float64 else _near_ties(
        kv, table, rows, torch.arange(2, 2 + num_new), torch.arange(start, start + num_new), k)
    _check(a, b, exact=sdt == torch.float64, skip=skip)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_exact_zero_ties_go_to_the_earlier_key(monkeypatch, dt):
    """Keys with every component <= 0 against queries with every component >= 0: every head's dot
    product is <= 0, so those keys score exactly 0 (ReLU), and k falls among them: the earliest win."""
    sdt, pdt = dt
    P, pages, d, H, n, k = 8, 32, 24, 4, 20, 90
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, pages, P, d, generator=g)
    neg = torch.rand(1, pages, P, generator=g) < 0.7
    keys[neg] = -keys[neg].abs()
    keys[0, 3, 2] = 0  # a zero key: 0 exactly too
    kv = _pool(P, pages, d, pdt, keys=keys)
    rows = _rows(n, H, d, sdt, seed=4, q_sign=1)
    rows.w.abs_()  # positive head weights: the other keys score > 0 or 0
    table = torch.randperm(pages, generator=g)
    start = pages * P - n
    a = _candidates("torch", monkeypatch, kv, table, start, n, rows, k)
    b = _candidates("native", monkeypatch, kv, table, start, n, rows, k)
    pos_sc = (a[0] > 0).sum(dim=1)
    assert bool((pos_sc < k).all()) and bool((a[0][:, -1] == 0).all()), "the boundary is not an exact tie"
    _check(a, b, exact=sdt == torch.float64)
    zeros = b[1][b[0] == 0].view(-1)
    assert zeros.numel() > 0


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", ["random", "zeros", "sample_misses"])
def test_long_rows_select_from_a_sample(monkeypatch, dt, case):
    """Rows of 8192 keys and more guess the k-th score from a sample, then select within a band around
    it: random scores, a majority of exact zero ties at the boundary, and a sample that misses (the keys
    it reads score far above the rest; the kernel then selects over the whole row), all as torch."""
    sdt, pdt = dt
    P, d, H, k, n = 16, 16, 4, 2048, 8
    m = 9000
    pages = (m + P - 1) // P
    g = torch.Generator().manual_seed(21)
    keys = torch.randn(1, pages, P, d, generator=g)
    if case == "zeros":
        neg = torch.rand(1, pages, P, generator=g) < 0.9
        keys[neg] = -keys[neg].abs()
    elif case == "sample_misses":  # the kernel samples key (i * m) / 512 + (m / 512) / 2 of a row of m
        flat = keys.view(-1, d)
        idx = torch.tensor([(i * m) // 512 + (m // 512) // 2 for i in range(512)])
        flat[idx] = flat[idx].abs() * 50
    kv = _pool(P, pages, d, pdt, keys=keys)
    rows = _rows(n, H, d, sdt, seed=22, q_sign=1 if case != "random" else 0)
    if case != "random":
        rows.w.abs_()
    table = torch.arange(pages)
    start = m - n + 1  # the last row sees m keys
    a = _candidates("torch", monkeypatch, kv, table, start, n, rows, k)
    b = _candidates("native", monkeypatch, kv, table, start, n, rows, k)
    if case == "zeros":
        assert bool((a[0][:, -1] == 0).all())
    skip = set() if sdt == torch.float64 else _near_ties(kv, table, rows, torch.arange(n),
                                                          torch.arange(start, start + n), k)
    _check(a, b, exact=sdt == torch.float64, skip=skip)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_many_tables_rows_threads_and_waves(monkeypatch, dt):
    """One call over rows of several tables (row_seq), in any order (rows), on 2 threads, with a score
    budget small enough to need several waves: each row as the torch path selects it alone."""
    sdt, pdt = dt
    P, pages, d, H, k = 4, 200, 40, 6, 16
    g = torch.Generator().manual_seed(9)
    kv = _pool(P, pages, d, pdt, seed=2)
    B, W = 5, 40
    tables = torch.full((B, W), -1, dtype=torch.long)
    ids = torch.randperm(pages, generator=g)
    for b in range(B):
        tables[b] = ids[b * W:(b + 1) * W]
        tables[b, torch.rand(W, generator=g) < 0.2] = -1
    N = 60
    rows = _rows(N, H, d, sdt, seed=5)
    positions = torch.randint(0, W * P, (N,), generator=g)
    positions[:3] = torch.tensor([0, 1, W * P - 1])
    row_seq = torch.sort(torch.randint(0, B, (N,), generator=g)).values  # groups of one table
    row_seq[10:14] = torch.tensor([3, 1, 3, 1])  # and rows alternating between tables
    order = torch.randperm(N, generator=g)
    monkeypatch.setattr(native, "_DSA_WAVE", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = native.index_topk(rows.q, rows.w, kv.store_flat("index_k", 0), P, tables, positions, k,
                                rows=order, row_seq=row_seq)
    finally:
        torch.set_num_threads(threads)
    for r in range(N):
        t = tables[row_seq[r]]
        i = int(order[r])
        s = SliceCtx(0, int(positions[i]), 1, 0, False, i, pages=t, page_size=P)
        ctx = SimpleNamespace(kv=kv, positions=positions, sparse=_pinned("torch"))
        want = sparse.local_candidates(0, s, rows, torch.tensor([i]), ctx, k)
        skip = set() if sdt == torch.float64 else _near_ties(kv, t, rows, torch.tensor([i]),
                                                              positions[i:i + 1], k)
        if not skip:
            _check(want, tuple(x[r:r + 1] for x in got), exact=sdt == torch.float64)


def test_no_rows_no_keys_and_bad_indices():
    P, d, H = 4, 8, 2
    kv = _pool(P, 6, d, torch.float32)
    keys = kv.store_flat("index_k", 0)
    rows = _rows(3, H, d, torch.float32)
    pos = torch.tensor([5, 9, 2])
    sc, ps, sl = native.index_topk(rows.q, rows.w, keys, P, torch.tensor([0, 1, 2]), pos, 4,
                                   rows=torch.zeros(0, dtype=torch.long))
    assert sc.shape == ps.shape == sl.shape == (0, 4)
    sc, ps, sl = native.index_topk(rows.q, rows.w, keys, P, torch.tensor([-1, -1, -1]), pos, 4)
    assert torch.isinf(sc).all() and bool((ps == -1).all()) and bool((sl == -1).all())
    sc, ps, sl = native.index_topk(rows.q, rows.w, keys, P, torch.tensor([2, -1, 0]), pos, 6)
    assert ps[2].tolist() == [0, 1, 2, -1, -1, -1] and sl[2].tolist() == [8, 9, 10, -1, -1, -1]
    assert ps[0].tolist() == [0, 1, 2, 3, -1, -1]  # page 1 is not held: position 5 sees page 0 only
    with pytest.raises(ValueError):
        native.index_topk(rows.q, rows.w, keys, P, torch.tensor([0, 1]), pos, 4, rows=torch.tensor([3]))
    with pytest.raises(ValueError):
        native.index_topk(rows.q, rows.w, keys, P, torch.tensor([0, 6]), pos, 4)  # page 6 of 6
    with pytest.raises(ValueError):
        native.index_topk(rows.q, rows.w, keys, P, torch.tensor([[0, 1]]), pos, 4,
                          row_seq=torch.tensor([0, 1, 0]))


class _Gathered:
    """A CP rank's comm whose all-gathers return every rank's tensors, computed beforehand."""

    def __init__(self, parts: list[list[torch.Tensor]], rank: int) -> None:
        self.parts, self.rank = parts, rank

    def all_gather(self, t: torch.Tensor, tag: int = 0) -> torch.Tensor:
        got = self.parts.pop(0)
        assert torch.equal(got[self.rank], t)
        return torch.stack(got)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_cp_merge_of_native_candidates_is_the_one_rank_selection(monkeypatch, kernel):
    """Pages sharded by position over T = 2 ranks (page j on rank j % 2): every rank's candidates,
    merged by CPLayout.select, select exactly the one-rank top-k, each rank keeping the keys it holds."""
    P, d, H, k, T = 4, 16, 4, 12, 2
    start, n = 30, 9
    npg = (start + n + P - 1) // P
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(npg, P, d, generator=g, dtype=torch.float64)
    keys[:, 1::3] = -keys[:, 1::3].abs()  # some exact zero scores (queries are positive below)
    rows = _rows(n, H, d, torch.float64, seed=12, q_sign=1)
    rows.w.abs_()
    positions = torch.arange(start, start + n)
    one = _pool(P, npg, d, torch.float64, keys=keys[None])
    s = SliceCtx(0, start, n, 0, False, 0, pages=torch.arange(npg), page_size=P)
    whole = SimpleNamespace(kv=one, positions=positions, sparse=_pinned(kernel))
    ref = sparse.local_candidates(0, s, rows, torch.arange(n), whole, k)[1]
    assert bool((ref[:, -1] >= 0).all())  # every row sees more than k keys
    ctxs = []
    for r in range(T):
        mine = [j for j in range(npg) if j % T == r]
        kv = _pool(P, len(mine) + 1, d, torch.float64)
        table = torch.full((npg,), -1, dtype=torch.long)
        for local, j in enumerate(mine):
            table[j] = local + 1  # local ids shifted: slots differ from positions
            kv.extra["index_k"][0, local + 1] = keys[j]
        sl = SliceCtx(0, start, n, 0, False, 0, pages=table, page_size=P)
        ctxs.append(SimpleNamespace(kv=kv, positions=positions, seqs=[sl], world=T, page_size=P,
                                    page_table=table[None], table=table, sparse=_pinned(kernel)))
    cands = [sparse.local_candidates(0, c.seqs[0], rows, torch.arange(n), c, k) for c in ctxs]
    sp = SimpleNamespace(rows=rows, k=k)
    for r, c in enumerate(ctxs):
        c.comm = _Gathered([[x[0] for x in cands], [x[1] for x in cands]], r)
        got = CPLayout().select(0, None, c, sp)
        for i in range(n):
            want = {int(c.table[p // P]) * P + p % P for p in ref[i].tolist() if c.table[p // P] >= 0}
            assert {v for v in got[i].tolist() if v >= 0} == want


def test_switches_keep_the_torch_path(monkeypatch):
    q = torch.zeros(1, 1, 8)
    keys = torch.zeros(4, 8)
    def index_kernel(q, keys, **kw):  # as a rank's kernels choose (the environment read into its config)
        return Kernels(EngineConfig.from_kwargs(**kw).kernels).index_kernel(q, keys)

    from splash.config import EngineConfig

    monkeypatch.delenv("SPLASH_ATTN_KERNEL", raising=False)
    monkeypatch.setenv("SPLASH_NATIVE", "1")
    assert index_kernel(q, keys) == "native"
    assert index_kernel(q.double(), keys.double()) == "native"
    assert index_kernel(q, keys.bfloat16()) == "native"
    assert index_kernel(q.double(), keys) == "torch"  # no kernel for that pair
    assert index_kernel(q.to("meta"), keys.to("meta")) == "torch"  # not CPU
    pins = (("SPLASH_ATTN_KERNEL", "torch"), ("SPLASH_ATTN_KERNEL", "triton"))
    for var, val in pins:
        with monkeypatch.context() as m:
            m.setenv(var, val)
            assert index_kernel(q, keys) == "torch"
    assert index_kernel(q, keys, enforce_eager=True) == "torch"  # --enforce-eager


def test_each_source_gets_its_own_cached_library():
    from splash.model.tiny import cache_dir

    assert native.library() is not None and native.dsa_library() is not None
    assert native.library() is not native.dsa_library()
    folder = os.path.join(cache_dir(), "kernels")
    for name in ("mla_paged", "dsa_index"):
        assert glob.glob(os.path.join(folder, f"{name}-*.so")), name
