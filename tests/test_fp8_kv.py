"""FP8 KV caches (`--kv-cache-dtype fp8_e4m3 | fp8_ds_mla`): the store table's element formats at run time.

Checked: the pool's bytes equal the analytical core's `kv_bytes_per_token` for every preset and format
(and what /metrics reports); a token's row is DeepSeek's layout, restated independently here (FP8 e4m3
with power-of-two float32 scales per 128, BF16 rotary key) and quantised per token (rows written
together or alone give the same bytes); the C paged kernel and the DSA index kernel read FP8 rows as
the torch path reads their decoded values; rows move between ranks as bytes, bit for bit; a float64
engine with an FP8 cache equals transformers with the same quantise-dequantise hooked into its cache
(1e-9); at T = 2 (every direction, a DSA model too) and T = 4 (one random schedule) an FP8 engine
switching layouts gives the T = 1 FP8 engine's tokens and logits; a fixed memory budget admits about
1.76x the tokens of BF16 at real MLA dims; formats that do not fit are refused with what to use.
"""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import run_ranks
from helpers_ckpt import build_checkpoint, hf_logits, hf_reference
from helpers_dsa import build_dsa_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from splash.attention import native, sparse
from splash.attention.kernel import attend
from splash.attention.kernels import Kernels
from splash.config import EngineConfig, KernelConfig
from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.core.sizes import kv_bytes_per_token, kv_bytes_per_token_layer
from splash.core.stores import token_stores
from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams
from splash.kv.pool import KVPool
from splash.server.metrics import ServerMetrics

FORMATS = ("bf16", "fp32", "fp8_e4m3", "fp8_ds_mla")
P = 4
NEW = 6
PROMPTS = [[5, 6, 7], list(range(10, 31)), list(range(3, 12)), [90, 1, 33, 4, 8, 61], list(range(40, 54))]
ENGINE = dict(dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=8, device="cpu")


# ---- an independent statement of the formats (not splash's codec) --------------------------------------
def qd_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise over the last dim with one power-of-two scale per `group` values:
    scale = 2^ceil(log2(max(amax, 1e-4) / 448)), as DeepSeek's FP8 caches (FlashMLA, the indexer)."""
    out = x.clone()
    for a in range(0, x.shape[-1], group):
        blk = x[..., a:a + group]
        amax = blk.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-4)
        s = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).to(x.dtype)
        out[..., a:a + group] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s
    return out


def qd_latent(c: torch.Tensor, k_pe: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What an FP8 cache gives back for a token's normed latent and roped rotary key."""
    if fmt == "fp8_ds_mla":
        return qd_groups(c), k_pe.to(torch.bfloat16).to(k_pe.dtype)
    e4 = lambda t: t.clamp(-448, 448).to(torch.float8_e4m3fn).to(t.dtype)  # noqa: E731 (scale 1.0)
    return e4(c), e4(k_pe)


# ---- bytes: the runtime's pool is the core's formula ---------------------------------------------------
def test_pool_bytes_equal_the_core_for_every_preset_and_format():
    for name, cfg in PRESETS.items():
        for c in (cfg, cfg.replace(num_nextn_predict_layers=1).with_draft(True)):  # (+ MTP draft KV)
            for fmt in FORMATS:
                pool = KVPool.for_model(c, 2, 3, torch.float32, kv_cache_dtype=fmt)
                want = kv_bytes_per_token(c, fmt)
                assert pool.nbytes == 2 * 3 * want == 2 * KVPool.bytes_per_page(c, 3, torch.float32, fmt), \
                    (name, fmt, pool.nbytes, want)
                layer = pool.latent_layers[0]
                row = pool.layer_width(layer) * pool.data.element_size()
                assert row == kv_bytes_per_token_layer(c, fmt, layer)
    v32 = PRESETS["deepseek-v3.2"]
    assert kv_bytes_per_token(v32, "fp8") == kv_bytes_per_token(v32, "fp8_ds_mla") == 788 * 61 == 48_068
    assert kv_bytes_per_token(PRESETS["deepseek-v3"], "fp8_e4m3") == 576 * 61
    v3 = PRESETS["deepseek-v3"]
    assert kv_bytes_per_token(v3, "bf16") / kv_bytes_per_token(v3, "fp8") == pytest.approx(1152 / 656)


def test_rows_are_deepseeks_layout_and_quantised_per_token():
    cfg = PRESETS["deepseek-v3"].replace(num_hidden_layers=1)
    pool = KVPool.for_model(cfg, 4, 4, torch.float64, kv_cache_dtype="fp8_ds_mla")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 576, generator=g, dtype=torch.float64)
    x *= torch.logspace(-3, 1, 16, dtype=torch.float64)[:, None]  # magnitudes over four decades
    pool.write(0, torch.arange(16), x)
    raw = pool.flat_layer(0)
    assert raw.dtype == torch.uint8 and raw.shape[-1] == 656  # FlashMLA's token: 512 + 4 x 4 + 64 x 2
    c, pe = x[:, :512], x[:, 512:]
    scales = raw[:, 512:528].contiguous().view(torch.float32)
    amax = c.view(16, 4, 128).abs().amax(-1).float()
    assert torch.equal(scales, torch.exp2(torch.ceil(torch.log2(amax / 448))))
    want = (c / scales.double().repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    assert torch.equal(raw[:, :512].view(torch.float8_e4m3fn).to(torch.float64), want.to(torch.float64))
    assert torch.equal(raw[:, 528:].contiguous().view(torch.bfloat16), pe.to(torch.bfloat16))
    want_c, want_pe = qd_latent(c, pe, "fp8_ds_mla")
    assert torch.equal(pool.gather(0, torch.arange(16)), torch.cat([want_c, want_pe], dim=1))
    # per token: a row's bytes do not depend on which rows were written with it (so not on the layout)
    alone = KVPool.for_model(cfg, 4, 4, torch.float64, kv_cache_dtype="fp8_ds_mla")
    for i in torch.randperm(16, generator=g).tolist():
        alone.write(0, torch.tensor([i]), x[i:i + 1])
    assert torch.equal(alone.data, pool.data)
    e4 = KVPool.for_model(cfg, 4, 4, torch.float64, kv_cache_dtype="fp8_e4m3")
    e4.write(0, torch.arange(16), x)
    assert e4.flat_layer(0).shape[-1] == 576
    assert torch.equal(e4.gather(0, torch.arange(16)), torch.cat(qd_latent(c, pe, "fp8_e4m3"), dim=1))


@pytest.mark.skipif(native.library() is None or native.dsa_library() is None, reason="no C compiler")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_kernels_dequantise_fp8_rows_in_their_loops(fmt, dtype):
    """The C paged kernel over FP8 bytes (or a BF16 cache under wider queries) = the torch kernel over
    the decoded keys; the sparse (selected keys) path too; the DSA index kernel over FP8 keys selects
    what the torch path selects."""
    cfg = PRESETS["tiny-dsa"].replace(kv_lora_rank=160, index_head_dim=136)  # a short last tile of 128
    pool = KVPool.for_model(cfg, 12, 4, dtype, kv_cache_dtype=fmt)
    g = torch.Generator().manual_seed(2)
    n = pool.num_tokens
    pool.write(0, torch.arange(n), torch.randn(n, cfg.latent_dim, generator=g).to(dtype))
    pool.write_store("index_k", 0, torch.arange(n), torch.randn(n, cfg.index_head_dim, generator=g).to(dtype))
    h, d_c, d_r = 5, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    ql = torch.randn(3, h, d_c, generator=g).to(dtype) * 0.2
    qp = torch.randn(3, h, d_r, generator=g).to(dtype) * 0.2
    tables = torch.tensor([[3, 7, -1, 1, 0, 9, -1, -1], [2, 4, 5, 6, 8, 10, 11, -1]])
    row_seq, row_pos = torch.tensor([0, 1, 1]), torch.tensor([22, 9, 26])
    out, lse = native.paged_attention(ql, qp, pool.layer(0), tables, row_seq, row_pos, 0.1, True,
                                      pool.kernel_format(0))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for r in range(3):
        t = tables[row_seq[r]]
        pos = torch.arange(t.shape[0] * 4)
        held = (t[pos // 4] >= 0) & (pos <= row_pos[r])
        keys = pool.gather(0, (t[pos // 4] * 4 + pos % 4)[held])
        o, ls = attend(ql[r:r + 1], qp[r:r + 1], keys, pos[held], row_pos[r:r + 1], 0.1, lse=True)
        assert (out[r:r + 1].double() - o.double()).abs().max() < tol
        assert (lse[r:r + 1].double() - ls.double()).abs().max() < tol
    sel = torch.tensor([[0, 5, 17, -1], [40, 3, 2, 1], [-1, -1, -1, 44]])
    got, _ = sparse.attend_selected(ql, qp, pool, 0, sel, 0.1)
    torch_only = Kernels(KernelConfig(attention_kernel="torch"))  # (SPLASH_ATTN_KERNEL=torch)
    want, _ = sparse.attend_selected(ql, qp, pool, 0, sel, 0.1, kernels=torch_only)
    assert (got.double() - want.double()).abs().max() < tol
    assert pool.kernel_format(0) is not None  # every case here ran in the kernel, not the torch path
    if dtype == torch.bfloat16 or fmt == "bfloat16":
        return
    keys = pool.store_flat("index_k", 0)
    assert keys.dtype == torch.uint8 and keys.shape[-1] == 136 + 8
    q = torch.randn(4, 3, 136, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype)
    positions = torch.tensor([30, 12, 7, 25])
    sc, ps, sl = native.index_topk(q, w, keys, 4, tables[1], positions, 6)
    dec = pool.gather_store("index_k", 0, torch.arange(n))
    for r in range(4):
        t = tables[1]
        pos = torch.arange(t.shape[0] * 4)
        held = (t[pos // 4] >= 0) & (pos <= positions[r])
        slots = (t[pos // 4] * 4 + pos % 4)[held]
        s = sparse.index_scores(q[r:r + 1], w[r:r + 1], dec[slots])
        best, col = sparse.top_keys(s, 6)
        assert set(sl[r][sl[r] >= 0].tolist()) == set(slots[col[0]][torch.isfinite(best[0])].tolist())


def _move_rows(grid, fmt: str) -> tuple[bool, int, int]:
    """Rank r sends its FP8 rows of one layer to rank r+1 the way the switch executor does (read_rows ->
    all_to_all -> write_rows): the received pages' bytes equal the sender's."""
    cfg = PRESETS["tiny-dsa"]
    pool = KVPool.for_model(cfg, 8, 4, torch.float64, kv_cache_dtype=fmt)
    g = torch.Generator().manual_seed(grid.rank)
    pool.write(0, torch.arange(32), torch.randn(32, cfg.latent_dim, generator=g, dtype=torch.float64))
    pool.write_store("index_k", 0, torch.arange(32), torch.randn(32, cfg.index_head_dim, generator=g,
                                                                  dtype=torch.float64))
    send = torch.arange(8)  # slots 0..7 out, into slots 16..23 of the next rank
    rows = pool.read_rows(0, send)
    T, me = grid.world, grid.rank
    counts = [8 if r == (me + 1) % T else 0 for r in range(T)]
    recv_counts = [8 if r == (me - 1) % T else 0 for r in range(T)]
    got = grid.comm.all_to_all_var(rows, counts, tag=7, recv_counts=recv_counts)
    pool.write_rows(0, torch.arange(16, 24), got)
    src = torch.Generator().manual_seed((me - 1) % T)
    other = KVPool.for_model(cfg, 8, 4, torch.float64, kv_cache_dtype=fmt)
    other.write(0, torch.arange(32), torch.randn(32, cfg.latent_dim, generator=src, dtype=torch.float64))
    other.write_store("index_k", 0, torch.arange(32), torch.randn(32, cfg.index_head_dim, generator=src,
                                                                   dtype=torch.float64))
    same = torch.equal(pool.read_rows(0, torch.arange(16, 24)), other.read_rows(0, send))
    return same, int(rows.shape[-1]), int(rows.element_size())


@pytest.mark.timeout(120)
def test_rows_move_between_ranks_as_bytes():
    cfg = PRESETS["tiny-dsa"]
    for same, width, elem in run_ranks(2, _move_rows, "fp8_ds_mla"):
        assert same
        assert width * elem == kv_bytes_per_token_layer(cfg, "fp8_ds_mla", 0)  # latent + indexer key bytes


def test_formats_that_do_not_fit_are_refused():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_ds_mla"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="fp8_e4m3 or fp8_ds_mla"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        EngineConfig(kv_cache_dtype="int4")


# ---- the engine ------------------------------------------------------------------------------------
def run(eng, prompts=PROMPTS, new=NEW):
    """Greedy tokens per prompt and {(prompt, position): logits row} of every sampled row."""
    logits: dict[tuple[int, int], torch.Tensor] = {}

    def hook(plan, seqs, rows):
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
            logits[(int(seq.group.request_id), len(seq.output_token_ids))] = row.clone()

    eng.logits_hook = hook
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=params)
    done: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
        assert not eng.scheduler.book_errors()
    eng.logits_hook = None
    return [done[i] for i in range(len(prompts))], logits


def close(a: dict, b: dict, name: str) -> None:
    assert a.keys() == b.keys(), name
    err = max((a[k] - b[k]).abs().max().item() for k in a)
    assert err < 1e-9, f"{name}: logits differ from the T = 1 FP8 engine by {err:.2e}"


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("fp8") / "v3", "v3", seed=3)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return build_dsa_checkpoint(tmp_path_factory.mktemp("fp8-v32") / "v32", "v32", seed=4, index_head_dim=48,
                                index_topk=4)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return build_dsa_checkpoint(tmp_path_factory.mktemp("fp8-dsa") / "glm", "glm", seed=3, index_head_dim=48,
                                index_topk=4)


def one_rank(path: str, fmt: str):
    eng = build_engine(model=path, num_kv_pages=64, kv_cache_dtype=fmt, **ENGINE)
    try:
        return run(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def refs(v3, v32, glm):
    """The T = 1 FP8 engines' tokens and logits (the reference every layout and switch must give)."""
    return {(name, "fp8_ds_mla"): one_rank(path, "fp8_ds_mla")
            for name, path in (("v3", v3), ("v32", v32), ("glm", glm))}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_e4m3"])
def test_float64_engine_equals_transformers_with_the_same_quantisation(v3, fmt, monkeypatch):
    """transformers' DeepSeek-V3 with its cache's normed latent and roped key quantised-dequantised
    per token as the format stores them (a hook here) gives the FP8 engine's logits to 1e-9."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as m

    toks, logits = one_rank(v3, fmt)
    hf = hf_reference(v3)
    for layer in hf.model.layers:
        layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda mod, args, out: qd_latent(out, out[..., :0], fmt)[0])
    for fn in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
        real = getattr(m, fn)

        def wrapped(q, k, *a, _real=real, **kw):
            q, k = _real(q, k, *a, **kw)
            return q, qd_latent(k[..., :0], k, fmt)[1]

        monkeypatch.setattr(m, fn, wrapped)
    _, plain = one_rank(v3, "auto")
    for i, p in enumerate(PROMPTS):
        ref = hf_logits(hf, p + toks[i])
        for j in range(NEW):
            row = ref[len(p) - 1 + j]
            assert int(row.argmax()) == toks[i][j]
            err = (logits[(i, j)] - row).abs().max().item()
            assert err < 1e-9, f"{fmt} prompt {i} token {j}: {err:.2e} from the hooked reference"
    drift = max((logits[k] - plain[k]).abs().max().item() for k in plain)
    assert drift > 1e-6, "the FP8 cache changed nothing: is it quantising?"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("one_torch_thread")
def test_layouts_and_switches_equal_the_one_rank_fp8_engine(group, v3, v32, glm, refs):
    """T = 2: all 12 directions on V3 and on a GLM-5-shaped DSA model (FP8 indexer keys move with the
    pages), a random schedule from DP on DeepSeek-V3.2's shape. T = 4: one random schedule on V3 (lean:
    one T = 4 case). The switch planner prices pages in the format's bytes (the manifests)."""
    circuit = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
    all12 = ",".join(f"{i + 1}:{lay}" for i, lay in enumerate(circuit[1:]))
    rnd = random.Random(group.world)
    lays = [rnd.choice(["tp", "dp", "cp", "dop"]) for _ in range(6)]
    schedule = ",".join(f"{2 * i + 1}:{lay}" for i, lay in enumerate(lays))
    if group.world == 4:
        cases = [("v3", v3, "dop", schedule)]
    else:
        cases = [("v3", v3, "tp", all12), ("glm", glm, "tp", all12), ("v32", v32, "dp", schedule)]
    for name, path, start, schedule in cases:
        ref_toks, ref_logits = refs[(name, "fp8_ds_mla")]
        eng = build_engine(model=path, layout=start, rank_group=group, num_kv_pages=96,
                           switch_schedule=schedule, kv_cache_dtype="fp8_ds_mla", **ENGINE)
        try:
            toks, logits = run(eng)
            st = eng.stats()
            moved = [e.bytes_per_layer for e in eng.switcher.events if e.refused is None]
            planner = eng.switcher.planner
            cfg = eng.runner.local.model.cfg
            assert planner.sizes.k == kv_bytes_per_token(cfg, "fp8_ds_mla")
            assert planner.page_bytes == P * kv_bytes_per_token(cfg, "fp8_ds_mla")
        finally:
            eng.shutdown()
        label = f"{name} T={group.world} {schedule}"
        assert toks == ref_toks, f"{label}: tokens differ from the T = 1 FP8 engine"
        close(logits, ref_logits, label)
        assert st["kv_dtype"] == "fp8_ds_mla" and st["num_switches"] >= 3 and any(b > 0 for b in moved)


@pytest.mark.timeout(120)
def test_a_memory_budget_admits_about_1_76x_the_tokens_of_bf16(tmp_path):
    """Real MLA dims (d_c 512, d_r 64): 1,152 BF16 bytes a token and layer against FP8's 656."""
    path = build_checkpoint(tmp_path / "mla", "v3", seed=1, kv_lora_rank=512, qk_rope_head_dim=64)
    got = {}
    for fmt in ("auto", "fp8_ds_mla", "fp8_e4m3"):
        eng = build_engine(model=path, dtype="bfloat16", device="cpu", memory_per_rank="64MiB", page_size=16,
                           max_num_seqs=4, max_num_batched_tokens=64, kv_cache_dtype=fmt)
        try:
            st = eng.stats()
            got[fmt] = st["kv_pages_total"] * 16
            per_token = sum(st["kv_bytes_per_token"].values())
            cfg = eng.runner.model.cfg
            assert per_token == kv_bytes_per_token(cfg, "bf16" if fmt == "auto" else fmt)
            assert set(st["kv_bytes_per_token"]) == {s.name for s in token_stores(cfg)}
            metrics = ServerMetrics("mla")
            metrics.refresh(st)
            text = metrics.render().decode()
            got_m = {s.labels["store"]: s.value for f in text_string_to_metric_families(text)
                     for s in f.samples if s.name == "splash:kv_bytes_per_token"}
            assert got_m == {k: float(v) for k, v in st["kv_bytes_per_token"].items()}
        finally:
            eng.shutdown()
    ratio = got["fp8_ds_mla"] / got["auto"]
    assert ratio == pytest.approx(1152 / 656, rel=0.01), ratio
    assert got["fp8_e4m3"] / got["auto"] == pytest.approx(1152 / 576, rel=0.01)


@pytest.mark.timeout(120)
def test_prefix_cache_shares_fp8_pages(v3):
    """Requests sharing a prompt prefix reuse its FP8 pages and give what uncached prefills give."""
    shared = list(range(60, 77))
    prompts = [shared + [3, 4], shared + [9], shared + [5, 6, 7]]
    out = {}
    for cache in (True, False):
        eng = build_engine(model=v3, num_kv_pages=64, kv_cache_dtype="fp8_ds_mla",
                           enable_prefix_caching=cache,
                           **{**ENGINE, "max_num_seqs": 1})  # one at a time: the later ones find the prefix
        try:
            out[cache] = run(eng, prompts)
            hits = eng.stats().get("prefix_cache_hits", 0)
        finally:
            eng.shutdown()
        assert (hits >= 2 * 16) if cache else hits == 0, hits
    assert out[True][0] == out[False][0]
    close(out[True][1], out[False][1], "prefix cache")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mtp_drafts_keep_their_kv_in_fp8_and_change_no_token(tmp_path):
    """MTP speculation over an FP8 cache (the draft layer's latent is a row of the latent's tensor, so
    FP8 too): the greedy tokens are the non-speculating FP8 engine's."""
    from helpers_ckpt import add_mtp_layer

    path = add_mtp_layer(build_checkpoint(tmp_path / "mtp", "v3", seed=6), seed=1)
    plain = one_rank(path, "fp8_ds_mla")
    eng = build_engine(model=path, num_kv_pages=64, kv_cache_dtype="fp8_ds_mla", speculative_algorithm="MTP",
                       speculative_policy="always", **ENGINE)
    try:
        spec = run(eng)
        st = eng.stats()
        assert eng.runner.pool.packed and "mtp_latent" in st["kv_bytes_per_token"]
        assert st["spec_draft_tokens"] > 0
    finally:
        eng.shutdown()
    assert spec[0] == plain[0]


@pytest.mark.timeout(120)
def test_torch_paths_read_fp8_as_the_kernels_do(v3, glm, refs):
    """--enforce-eager (the torch reference paths: batched page gathers, the MHA form's decompressed
    keys, the DSA torch top-k) over the same FP8 cache gives the kernels' tokens and logits."""
    for name, path in (("v3", v3), ("glm", glm)):
        eng = build_engine(model=path, num_kv_pages=64, kv_cache_dtype="fp8_ds_mla", enforce_eager=True,
                           **ENGINE)
        try:
            toks, logits = run(eng)
        finally:
            eng.shutdown()
        assert toks == refs[(name, "fp8_ds_mla")][0], name
        close(logits, refs[(name, "fp8_ds_mla")][1], f"{name} eager")


@pytest.mark.timeout(120)
def test_fp8_e4m3_takes_the_checkpoints_k_scale(tmp_path):
    """A checkpoint's per-layer `self_attn.k_scale` (vLLM's name) is the layer's FP8 scale: the cache
    stores latent / scale in FP8; a layer without one keeps 1.0."""
    from safetensors.torch import load_file, save_file

    path = build_checkpoint(tmp_path / "scaled", "v3", seed=2)
    file = f"{path}/model.safetensors"
    w = load_file(file)
    w["model.layers.0.self_attn.k_scale"] = torch.tensor(0.3, dtype=torch.float64)
    save_file(w, file, metadata={"format": "pt"})
    eng = build_engine(model=path, num_kv_pages=16, kv_cache_dtype="fp8_e4m3", **ENGINE)
    try:
        pool = eng.runner.pool
        assert pool.tensor_scale == {0: 0.3}
        x = torch.randn(4, pool.dim, dtype=torch.float64) * 3
        pool.write(0, torch.arange(4), x)
        pool.write(1, torch.arange(4), x)
        e4 = lambda t: t.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64)  # noqa: E731
        assert torch.equal(pool.gather(0, torch.arange(4)), e4(x / 0.3) * 0.3)
        assert torch.equal(pool.gather(1, torch.arange(4)), e4(x))
        if native.library() is not None:  # the kernel applies the scale as the torch path does
            q = torch.randn(2, 3, pool.dim, dtype=torch.float64)
            d_c = eng.runner.model.cfg.kv_lora_rank
            got, _ = native.paged_attention(q[..., :d_c], q[..., d_c:], pool.layer(0),
                                            torch.tensor([[0]]), torch.zeros(2, dtype=torch.long),
                                            torch.tensor([1, 3]), 0.1, False, pool.kernel_format(0))
            keys = pool.gather(0, torch.arange(4))
            for r, last in enumerate((1, 3)):
                want, _ = attend(q[r:r + 1, :, :d_c], q[r:r + 1, :, d_c:], keys[:last + 1],
                                 torch.arange(last + 1), torch.tensor([last]), 0.1)
                assert (got[r:r + 1] - want).abs().max() < 1e-13
        toks, _ = run(eng, PROMPTS[:2], 3)
        assert all(len(t) == 3 for t in toks)
    finally:
        eng.shutdown()
