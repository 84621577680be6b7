"""The Triton MLA decode kernel (splash/attention/triton_mla.py) against the torch reference kernel.

Runs where `triton` imports: on a GPU for real, elsewhere under Triton's CPU interpreter
(TRITON_INTERPRET=1, set here before triton is imported when no CUDA device is visible). The shared venv
has no triton, so CI skips this file; `PYTHONPATH=$PWD:/path/to/triton pytest tests/test_triton_mla.py`
runs it (docs/runtime.md). Cases: decode rows and chunk rows, CP-style holes in the page tables (-1),
rows that see no key (out 0, lse -inf), head counts that do not fill a head block, 1 and several key
splits (flash-decoding parts merged by log-sum-exp), float64 / float32 / bfloat16.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the shared venv has none; see the module docstring)",
                allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from splash.attention import triton_mla  # noqa: E402
from splash.attention.kernel import attend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpreter_numpy_fix() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into loop bounds with
    int(array), which numpy >= 2.4 refuses ("only 0-dimensional arrays"): read the one element instead.
    Interpreter only; a GPU never runs this code."""
    from triton.runtime import interpreter as ti

    orig = ti._patch_lang_tensor
    if getattr(orig, "_splash_fixed", False):
        return

    def patched(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._splash_fixed = True
    ti._patch_lang_tensor = patched


if DEV.type == "cpu":
    _interpreter_numpy_fix()
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_case(dtype: torch.dtype, *, heads: int = 5, d_c: int = 32, d_r: int = 16, P: int = 4,
              ctx: tuple[int, ...] = (1, 7, 13, 30), holes: bool = False, chunk: int = 1, seed: int = 0):
    """A pool, page tables (shuffled pages; with `holes` every other page not held, as CP's shard) and
    query rows: `chunk` rows per request ending at its last position."""
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    W = max(-(-c // P) for c in ctx) + 1  # one spare column: -1 padding as in a real table
    pages = B * W + 3
    pool = torch.randn(pages, P, d_c + d_r, generator=g, dtype=torch.float64)
    perm = torch.randperm(pages, generator=g)
    table = torch.full((B, W), -1, dtype=torch.long)
    k = 0
    for b, c in enumerate(ctx):
        for j in range(-(-c // P)):
            if not (holes and (j + b) % 2 == 1):
                table[b, j] = perm[k]
            k += 1
    row_seq = torch.tensor([b for b, c in enumerate(ctx) for _ in range(min(chunk, c))], dtype=torch.long)
    row_pos = torch.tensor([p for c in ctx for p in range(c - min(chunk, c), c)], dtype=torch.long)
    n = len(row_seq)
    q = torch.randn(n, heads, d_c + d_r, generator=g, dtype=torch.float64)
    q_lat, q_pe = q[..., :d_c].to(dtype), q[..., d_c:].to(dtype)
    return pool.to(dtype), table, row_seq, row_pos, q_lat, q_pe


def reference(pool, table, row_seq, row_pos, q_lat, q_pe, scale):
    """Row by row through `kernel.attend` over the held keys (computed in float64)."""
    P = pool.shape[1]
    flat = pool.double().reshape(-1, pool.shape[-1])
    outs, lses = [], []
    for r in range(q_lat.shape[0]):
        t = table[row_seq[r]]
        pos = torch.arange(t.shape[0] * P)
        held = (t[pos // P] >= 0) & (pos <= row_pos[r])
        slots = (t[pos // P] * P + pos % P)[held]
        o, lse = attend(q_lat[r:r + 1].double(), q_pe[r:r + 1].double(), flat[slots], pos[held],
                        row_pos[r:r + 1], scale, lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run(dtype, splits=None, **kw):
    pool, table, row_seq, row_pos, q_lat, q_pe = make_case(dtype, **kw)
    scale = 0.1234567891234
    want_o, want_l = reference(pool, table, row_seq, row_pos, q_lat, q_pe, scale)
    out, lse = triton_mla.paged_attention(q_lat.to(DEV), q_pe.to(DEV), pool.to(DEV), table.to(DEV),
                                          row_seq.to(DEV), row_pos.to(DEV), scale, lse=True, splits=splits)
    assert out.dtype == dtype and out.shape == q_lat.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    err_o = (out.double().cpu() - want_o).abs().max().item() / max(1.0, want_o.abs().max().item())
    lse = lse.double().cpu()
    inf = torch.isinf(want_l)
    assert torch.equal(torch.isinf(lse), inf), "rows without keys must get lse -inf, and only they"
    err_l = (lse[~inf] - want_l[~inf]).abs().max().item() if (~inf).any() else 0.0
    return err_o, err_l


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_rows(dtype, splits):
    err_o, err_l = run(dtype, splits=splits)
    assert err_o < TOL[dtype] and err_l < TOL[dtype], (err_o, err_l)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_holes_chunks_and_empty_rows(dtype):
    # CP's shard: a row whose only key is on a page this rank lacks sees nothing (out 0, lse -inf)
    err_o, err_l = run(dtype, splits=2, ctx=(1, 2, 9, 22), holes=True, chunk=3, heads=17, seed=1)
    assert err_o < TOL[dtype] and err_l < TOL[dtype], (err_o, err_l)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fp8_and_bf16_caches_dequantised_in_the_loop(fmt, dtype):
    """An FP8 cache's byte rows (a latent of 160: a short last tile of 128) or a BF16 cache under wider
    queries, through `KVPool.kernel_format`: the kernel equals the reference over the decoded keys."""
    from splash.core.presets import PRESETS
    from splash.kv.pool import KVPool

    cfg = PRESETS["tiny"].replace(kv_lora_rank=160, num_hidden_layers=1)
    pool = KVPool.for_model(cfg, 12, 4, dtype, kv_cache_dtype=fmt)
    g = torch.Generator().manual_seed(3)
    n = pool.num_tokens
    pool.write(0, torch.arange(n), torch.randn(n, cfg.latent_dim, generator=g, dtype=torch.float64).to(dtype))
    table = torch.tensor([[3, 7, -1, 1, 0, 9, -1, -1], [2, 4, 5, 6, 8, 10, 11, -1]])
    row_seq, row_pos = torch.tensor([0, 1, 1]), torch.tensor([22, 9, 26])
    q_lat = torch.randn(3, 5, 160, generator=g, dtype=torch.float64).to(dtype) * 0.2
    q_pe = torch.randn(3, 5, cfg.qk_rope_head_dim, generator=g, dtype=torch.float64).to(dtype) * 0.2
    keys = pool.decode(0, pool.layer(0)).double()  # every row decoded, for the reference only
    want_o, want_l = reference(keys, table, row_seq, row_pos, q_lat, q_pe, 0.1)
    out, lse = triton_mla.paged_attention(q_lat.to(DEV), q_pe.to(DEV), pool.layer(0).to(DEV), table.to(DEV),
                                          row_seq.to(DEV), row_pos.to(DEV), 0.1, lse=True,
                                          fmt=pool.kernel_format(0))
    assert (out.double().cpu() - want_o).abs().max().item() < TOL[dtype]
    fin = torch.isfinite(want_l)
    assert (lse.double().cpu()[fin] - want_l[fin]).abs().max().item() < TOL[dtype]


def test_default_splits_and_strided_queries():
    """The split count planned from the shape (what the engine launches), queries as views of a wider
    tensor (the absorbed projections leave them strided)."""
    pool, table, row_seq, row_pos, q_lat, q_pe = make_case(torch.float32, ctx=(3, 17, 40, 64, 5, 11))
    wide = torch.cat([q_lat, q_pe], dim=-1)
    scale = 0.2
    want, _ = reference(pool, table, row_seq, row_pos, q_lat, q_pe, scale)
    d_c = q_lat.shape[-1]
    w = wide.to(DEV)
    out, none = triton_mla.paged_attention(w[..., :d_c], w[..., d_c:], pool.to(DEV), table.to(DEV),
                                           row_seq.to(DEV), row_pos.to(DEV), scale)
    assert none is None
    assert (out.double().cpu() - want).abs().max().item() < TOL[torch.float32]


@pytest.mark.skipif(DEV.type != "cpu", reason="the GPU engine is checked by tests/cuda_fast_check.py")
def test_float64_engine_on_the_interpreted_kernel(tmp_path, monkeypatch):
    """The whole T = 1 engine in float64 with every absorbed attention (prefill chunks and decode rows)
    through the Triton kernel, interpreted on CPU: transformers' greedy tokens, and the logits of the
    native-kernel engine within 1e-9."""
    from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference
    from test_engine_dist import ENGINE, NEW, PROMPTS, run

    from splash.engine.build import build_engine

    path = build_checkpoint(tmp_path / "v3", "v3", seed=2)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    monkeypatch.setenv("SPLASH_NATIVE", "1")
    eng = build_engine(model=path, num_kv_pages=64, attention_form="absorbed", **ENGINE)
    want_toks, want = run(eng, PROMPTS)
    eng.shutdown()
    calls = []
    real = triton_mla.paged_attention
    monkeypatch.setattr(triton_mla, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("SPLASH_ATTN_KERNEL", "triton")
    eng = build_engine(model=path, num_kv_pages=64, attention_form="absorbed", **ENGINE)
    toks, logits = run(eng, PROMPTS)
    failed = eng.runner.kernels.failed  # (the rank's kernels: dtypes Triton failed to compile for)
    eng.shutdown()
    assert calls and not failed
    assert toks == ref == want_toks
    err = max((logits[k] - want[k]).abs().max().item() for k in want)
    assert err < 1e-9, err
