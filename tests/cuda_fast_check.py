"""One-GPU check of the fast decode path (run by tests/cuda_check.sh; PYTHONPATH=.:tests python3 ...).

K. the Triton MLA kernel (splash/attention/triton_mla.py) against the torch reference kernel on the GPU:
   float64 / float32 / bf16, DeepSeek-V3's latent dims (512 + 64), 16 and 128 heads, CP-style holes, long
   contexts (several key splits); and the kernel captured in a CUDA graph, replayed on new row
   positions, equal to an eager launch (the bounds really are read from device memory).
E. the float64 engine on CUDA, three ways: the torch reference path (SPLASH_NATIVE=0, as --enforce-eager),
   the Triton kernel eager (SPLASH_CUDA_GRAPHS=0), Triton + CUDA graphs (the default): greedy tokens equal
   to transformers, every sampled row's logits within 1e-9 of transformers run on the same GPU.
T. eager vs graph decode steps of the `small` model (V3 MLA dims) in bf16 at a few batch sizes: ms per
   engine step (scheduler + forward + sampler) for torch-attention eager, Triton eager, Triton + graph.
Prints one PASS/FAIL line per check and exits 1 if any failed. PARTS=KET selects parts. DEV=cpu runs parts
E and T on CPU as a plumbing check of this script (the graphs replaced by their eager static forward), and
part K too with TRITON_INTERPRET=1 and triton on PYTHONPATH (interpreted, short contexts, no graph).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

sys.path[:0] = [".", "tests"]
FAILED: list[str] = []
DEV = os.environ.get("DEV", "cuda")
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def cpu_graphs(eng):
    """DEV=cpu: the static-buffer forward the graphs would capture, run eagerly (plumbing check)."""
    from splash.worker.cuda_graph import DecodeGraphs

    r = eng.runner
    r.graphs = DecodeGraphs(r.model, r.pool, r.kernels, sizes=(1, 2, 4, 8, 16, 32), capture=False)
    return r.graphs


def verdict(name: str, ok: bool, detail: str) -> None:
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        FAILED.append(name)


# ---- K: the kernel ---------------------------------------------------------------------------------
def case(dtype, heads, ctx, holes, P=16, d_c=512, d_r=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    B, W = len(ctx), max(-(-c // P) for c in ctx) + 1
    pages = B * W + 5
    pool = torch.randn(pages, P, d_c + d_r, generator=g, device=DEV, dtype=torch.float64)
    perm = torch.randperm(pages, generator=g, device=DEV)
    table = torch.full((B, W), -1, dtype=torch.long, device=DEV)
    k = 0
    for b, c in enumerate(ctx):
        for j in range(-(-c // P)):
            if not (holes and (j + b) % 2):
                table[b, j] = perm[k]
            k += 1
    q = torch.randn(B, heads, d_c + d_r, generator=g, device=DEV, dtype=torch.float64) * 0.1
    row_pos = torch.tensor([c - 1 for c in ctx], device=DEV)
    return (pool.to(dtype), table, torch.arange(B, device=DEV), row_pos, q[..., :d_c].to(dtype),
            q[..., d_c:].to(dtype))


def reference(pool, table, row_seq, row_pos, q_lat, q_pe, scale):
    from splash.attention.kernel import attend

    P, flat = pool.shape[1], pool.double().reshape(-1, pool.shape[-1])
    outs, lses = [], []
    for r in range(q_lat.shape[0]):
        t = table[row_seq[r]]
        pos = torch.arange(t.shape[0] * P, device=DEV)
        held = (t[pos // P] >= 0) & (pos <= row_pos[r])
        keys = flat[(t[pos // P] * P + pos % P)[held]]
        o, lse = attend(q_lat[r:r + 1].double(), q_pe[r:r + 1].double(), keys, pos[held], row_pos[r:r + 1],
                        scale, lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def part_k() -> None:
    from splash.attention import triton_mla

    if DEV == "cpu":  # DEV=cpu PARTS=K: interpreted (TRITON_INTERPRET=1), short contexts, no graph
        import test_triton_mla  # noqa: F401  (its interpreter fix)
    short = (lambda c: tuple(max(1, x // 40) for x in c)) if DEV == "cpu" else (lambda c: c)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for heads, ctx, holes in ((16, (1, 17, 300, 2049, 4000, 33, 64, 5), False),
                                  (128, (7, 900, 1, 2500), True), (16, (4096,), False)):
            ctx = short(ctx)
            pool, table, rs, rp, ql, qp = case(dtype, heads, ctx, holes)
            want_o, want_l = reference(pool, table, rs, rp, ql, qp, 0.0625)
            out, lse = triton_mla.paged_attention(ql, qp, pool, table, rs, rp, 0.0625, lse=True)
            fin = torch.isfinite(want_l)
            # relative to the largest output (bf16 rounds the output itself: 2^-9 of its size)
            err_o = (out.double() - want_o).abs().max().item() / max(1.0, want_o.abs().max().item())
            err_l = (lse.double()[fin] - want_l[fin]).abs().max().item() if fin.any() else 0.0
            same_inf = bool(torch.equal(torch.isinf(lse), ~fin))
            splits = triton_mla.plan_splits(len(ctx), -(-heads // (1 if dtype == torch.float64 else 16)),
                                            pool.device)
            verdict(f"kernel {str(dtype)[6:]} h={heads} rows={len(ctx)} holes={holes} splits={splits}",
                    err_o < tol[dtype] and err_l < tol[dtype] and same_inf,
                    f"max |out - ref| / max(1, |ref|) {err_o:.1e}, |lse - ref| {err_l:.1e} "
                    f"(tol {tol[dtype]:.0e}), empty rows -inf: {same_inf}")
    # FP8 caches (--kv-cache-dtype fp8_e4m3 / fp8_ds_mla): the Triton kernel dequantises the byte rows
    # in its loop; the reference attends the rows the pool's codec decodes (real MLA dims 512 + 64)
    from splash.core.presets import PRESETS
    from splash.kv.pool import KVPool

    cfg = PRESETS["deepseek-v3"]
    for fmt in ("fp8_e4m3", "fp8_ds_mla"):
        for dtype in (torch.float32, torch.bfloat16):
            kv = KVPool.for_model(cfg.replace(num_hidden_layers=1), 64, 16, dtype, DEV, fmt)
            gen = torch.Generator().manual_seed(1)
            n = kv.num_tokens
            x = torch.randn(n, cfg.latent_dim, generator=gen).to(DEV, dtype)
            kv.write(0, torch.arange(n, device=DEV), x)
            table = torch.randperm(64, generator=gen).view(2, 32).to(DEV)
            rs, rp = torch.tensor([0, 1, 1], device=DEV), torch.tensor([300, 17, 511], device=DEV)
            ql = torch.randn(3, 16, cfg.kv_lora_rank, generator=gen).to(DEV, dtype) * 0.05
            qp = torch.randn(3, 16, cfg.qk_rope_head_dim, generator=gen).to(DEV, dtype) * 0.05
            dec = kv.decode(0, kv.layer(0))  # [pages, P, D] values
            want_o, want_l = reference(dec, table, rs, rp, ql, qp, 0.0625)
            out, lse = triton_mla.paged_attention(ql, qp, kv.layer(0), table, rs, rp, 0.0625, lse=True,
                                                  fmt=kv.kernel_format(0))
            err = (out.double() - want_o).abs().max().item() / max(1.0, want_o.abs().max().item())
            verdict(f"kernel {fmt} {str(dtype)[6:]}", err < tol[dtype], f"max |out - ref| {err:.1e}")
    if DEV == "cpu":
        return
    # graph capture: same launch, new positions written into the captured row_pos buffer
    pool, table, rs, rp, ql, qp = case(torch.bfloat16, 16, (40, 800, 1500, 3000), False, seed=3)
    triton_mla.paged_attention(ql, qp, pool, table, rs, rp, 0.0625)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = triton_mla.paged_attention(ql, qp, pool, table, rs, rp, 0.0625)
    rp.copy_(torch.tensor([10, 799, 100, 2999], device=DEV))
    g.replay()
    want, _ = triton_mla.paged_attention(ql, qp, pool, table, rs, rp, 0.0625)
    verdict("kernel in a CUDA graph, replayed on new positions", torch.equal(out, want),
            f"max |graph - eager| {(out.float() - want.float()).abs().max().item():.1e} (want bit-equal)")
    # speed of the kernel alone against the torch reference path's batched groups, bf16
    pool, table, rs, rp, ql, qp = case(torch.bfloat16, 16, tuple([2048] * 64), False, seed=4)
    for name, fn in (("triton", lambda: triton_mla.paged_attention(ql, qp, pool, table, rs, rp, 0.0625)),
                     ("torch gather+matmul", lambda: torch_batched(pool, table, rp, ql, qp))):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / 20 * 1e3
        log(f"  kernel time, 64 rows x 2048 keys, 16 heads, bf16: {name} {ms:.3f} ms")


def torch_batched(pool, table, row_pos, q_lat, q_pe):
    """What the torch path does for a decode group: gather whole pages, one masked softmax."""
    B, W = table.shape
    P, D = pool.shape[1], pool.shape[2]
    keys = pool.view(pool.shape[0], -1).index_select(0, table.clamp(min=0).view(-1)).view(B, W * P, D)
    s = torch.bmm(torch.cat([q_lat, q_pe], -1), keys.transpose(1, 2)).float() * 0.0625
    late = torch.arange(W * P, device=DEV)[None, :] > row_pos[:, None]
    s.masked_fill_(late[:, None, :], float("-inf"))
    return torch.bmm(torch.softmax(s, -1).to(keys.dtype), keys[..., :q_lat.shape[-1]])


# ---- E: the float64 engine on CUDA, three paths -------------------------------------------------------
def part_e(path) -> None:
    from helpers_ckpt import hf_greedy, hf_reference
    from test_engine_dist import ENGINE, NEW, PROMPTS, run

    from splash.engine.build import build_engine

    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    hf = hf.to(DEV)
    with torch.no_grad():
        hf_rows = {i: hf(torch.tensor([p + ref[i]], device=DEV)).logits[0] for i, p in enumerate(PROMPTS)}
    for name, env in (("torch reference (SPLASH_NATIVE=0)", {"SPLASH_NATIVE": "0"}),
                      ("triton eager (SPLASH_CUDA_GRAPHS=0)", {"SPLASH_CUDA_GRAPHS": "0"}),
                      ("triton + CUDA graphs", {})):
        saved = {k: os.environ.get(k) for k in ("SPLASH_NATIVE", "SPLASH_CUDA_GRAPHS")}
        os.environ.update({"SPLASH_NATIVE": "1", "SPLASH_CUDA_GRAPHS": "1", **env})
        try:
            eng = build_engine(model=path, num_kv_pages=64, **dict(ENGINE, device=DEV))
            graphs = eng.runner.graphs
            if DEV == "cpu" and "graphs" in name:
                graphs = cpu_graphs(eng)
            toks, logits = run(eng, PROMPTS)
            failed = eng.runner.kernels.failed  # the rank's kernels: dtypes Triton failed to compile for
            eng.shutdown()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        # the row sampled after j output tokens of prompt i predicts token j: HF position len(prompt)+j-1
        err = max((row - hf_rows[int(i)][len(PROMPTS[int(i)]) + j - 1]).abs().max().item()
                  for (i, j), row in logits.items())
        used = graphs.replays if graphs is not None else 0
        ok = toks == ref and err < 1e-9 and (used > 0) == ("graphs" in name) and not failed
        bad = sorted(map(str, failed))
        verdict(f"float64 engine on {DEV}, {name}", ok,
                f"tokens == transformers {toks == ref}; max |logit - transformers on {DEV}| {err:.1e} "
                f"(want < 1e-9); steps through graphs {used}; Triton failed for {bad}")


# ---- T: eager vs graph decode timing ---------------------------------------------------------------
def part_t() -> None:
    from splash.engine.build import build_engine
    from splash.engine.sampling import SamplingParams

    sizes = [int(x) for x in os.environ.get("BATCHES", "1,8,32,128").split(",")]
    eng = build_engine(model="small", dtype="bfloat16", device=DEV, max_num_seqs=max(sizes), page_size=16,
                       max_num_batched_tokens=max(sizes) * 32, num_kv_pages=max(sizes) * 16 + 64)
    runner = eng.runner
    graphs = runner.graphs if DEV == "cuda" else cpu_graphs(eng)
    rows = []
    steps, warm = 20, 4
    for B in sizes:
        sp = SamplingParams(temperature=0.0, max_tokens=3 * (steps + warm) + 8, ignore_eos=True)
        for i in range(B):
            prompt = [(7 * i + j) % 200 + 3 for j in range(32)]
            eng.add_request(f"{B}-{i}", prompt_token_ids=prompt, params=sp)
        for _ in range(3):  # the prefill (one step at this budget) and a first decode step
            eng.step()
        res = {}
        for name, kernel, g in (("torch eager", "torch", None), ("triton eager", "", None),
                                ("triton graph", "", graphs)):
            runner.kernels.pinned = kernel  # (what --attention-kernel / SPLASH_ATTN_KERNEL set at load)
            runner.graphs = g
            for _ in range(warm):  # a graph bucket is captured here
                eng.step()
            sync()
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            sync()
            res[name] = (time.perf_counter() - t) / steps * 1e3
        runner.kernels.pinned = ""
        if B == sizes[0] and DEV == "cuda":
            runner.graphs = None
            count_syncs(eng)  # the eager Triton forward: no host sync inside the model
        runner.graphs = graphs
        eng.abort_all()
        while eng.has_unfinished():
            eng.step()
        rows.append((B, res))
    eng.shutdown()
    log("decode step time, `small` model (V3 MLA dims, 4 layers), bf16, prompts of 32 tokens, ms per step:")
    log(f"  {'batch':>5} {'torch eager':>12} {'triton eager':>13} {'triton graph':>13} {'graph speedup':>14}")
    for B, r in rows:
        log(f"  {B:>5} {r['torch eager']:>12.2f} {r['triton eager']:>13.2f} {r['triton graph']:>13.2f} "
            f"{r['triton eager'] / r['triton graph']:>13.2f}x")
    captured = sorted(graphs.graphs) if graphs is not None else []
    if DEV == "cpu":
        captured = list(graphs.sizes) if graphs.replays else []
    failed = runner.kernels.failed
    verdict("decode graphs captured for the timed batches", graphs is not None and not graphs.failed
            and not failed
            and all(any(s >= B for s in captured) for B in sizes),
            f"captured {captured}, failed {sorted(graphs.failed) if graphs is not None else 'no graphs'}, "
            f"Triton failed for {sorted(map(str, failed))}")


def count_syncs(eng) -> None:
    """Host syncs of one eager decode step by source line (torch's sync debug mode); those of the runner,
    the context build, the model and attention must be none (the sampler's read of the tokens is
    expected)."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in ws
                                if "synchroniz" in str(w.message))
    inside = {k: v for k, v in where.items()
              if k.startswith(("splash/model/", "splash/attention/", "splash/worker/runner.py"))}
    verdict("no host sync in the eager decode step's context build and forward (pinned copies, Triton "
            "kernel, dense MoE)", not inside,
            f"inside the model: {inside}; all syncs of the step: {dict(where)}")


if __name__ == "__main__":
    if DEV == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device visible to torch; tests/cuda_fast_check.py needs the GPU machine")
        sys.exit(2)
    log(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu")
    parts = os.environ.get("PARTS", "KET" if DEV == "cuda" else "ET")
    for p, fn in (("K", part_k), ("E", None), ("T", part_t)):
        if p not in parts:
            continue
        try:
            if p == "E":
                from helpers_ckpt import build_checkpoint

                part_e(build_checkpoint(tempfile.mkdtemp() + "/v3", "v3", seed=5))
            else:
                fn()
        except Exception as e:  # noqa: BLE001  a crash is a failure of that part, the others still run
            import traceback

            traceback.print_exc()
            verdict(f"part {p}", False, f"crashed: {e!r}"[:300])
    log(f"fast-path checks: {'ALL PASS' if not FAILED else 'FAILED: ' + '; '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)
