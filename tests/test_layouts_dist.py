"""The four attention layouts on real gloo ranks give the single-process answer (float64, 1e-12).

One MLA layer with seeded weights, a KV history per request, and a batch of slices (prefill chunks,
decode rows, unequal lengths, a case with fewer requests than ranks) is rebuilt identically on every
rank; each layout runs it with its own page placement and projections, and every rank's [N, d] must
match an attention written here from scratch (and the T = 1 local layout). Bytes counted by the
communicator are checked against the counting convention and, for DOP, against SPEC Eq 4.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

from splash.attention.kernels import Kernels
from splash.attention.registry import NAMES, make_layout
from splash.config import KernelConfig
from splash.core.costmodel import eq4_bytes
from splash.core.model_config import ModelConfig
from splash.distributed.comm import LocalCommunicator
from splash.kv.pool import KVPool
from splash.model.mla import MLA
from splash.model.rope import Rotary
from splash.step.plan import SeqSlice
from splash.worker.context import build_context

pytestmark = pytest.mark.timeout(240)

CFG = ModelConfig(
    name="layout-test", model_type="deepseek_v3", vocab_size=16, hidden_size=32, intermediate_size=32,
    moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=8, q_lora_rank=24,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=None,
    n_shared_experts=None, num_experts_per_tok=None, attention_bias=True,
)
DT = torch.float64
P = 4  # page size
FORMS = ("absorbed", "mha", "auto")  # auto mixes them: in "mixed", the 6-row first chunk takes MHA
LAYER = 1  # attend layer 1 of a 2-layer pool, so a wrong layer index reads junk
NUM_PAGES = 24
D = CFG.kv_lora_rank + CFG.qk_rope_head_dim
H = CFG.num_attention_heads


def cases(world: int) -> dict[str, list[tuple[int, int, int]]]:
    """(start, num_new, owner) per slice. 'mixed': prefill chunks + decodes, every rank busy at
    T = 4 but unevenly; 'few': fewer requests than ranks, rank 0 owns nothing."""
    mixed = [(0, 6, 0), (9, 1, 1), (5, 4, 1), (13, 1, 3), (2, 1, 2), (0, 3, 0)]
    few = [(7, 2, world - 1), (0, 5, 1 % world)]
    return {"mixed": [(s, n, o % world) for s, n, o in mixed], "few": few}


def full_mla() -> MLA:
    g = torch.Generator().manual_seed(1234)
    mla = MLA(CFG, Rotary(CFG), range(H), DT)
    for _, buf in mla.named_buffers():
        if buf is not None and buf.dtype == DT:
            buf.copy_(torch.randn(buf.shape, generator=g, dtype=DT) * 0.3)
    return mla


def mla_for(full: MLA, sharded: bool, rank: int, world: int) -> MLA:
    if not sharded or world == 1:
        return full
    per = H // world
    heads = range(rank * per, (rank + 1) * per)
    m = full_mla()
    m.set_heads(heads, {k: v.clone() for k, v in full.head_tensors(heads).items()})
    return m


def inputs(case: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """q_in [N, q_lora], latent_new [N, D] and each request's cached history [start, D]."""
    g = torch.Generator().manual_seed(seed)
    n = sum(k for _, k, _ in case)
    q_in = torch.randn(n, CFG.q_lora_rank, generator=g, dtype=DT)
    latent_new = torch.randn(n, D, generator=g, dtype=DT)
    hist = [torch.randn(s, D, generator=g, dtype=DT) for s, _, _ in case]
    return q_in, latent_new, hist


def holders(kind, page: int, owner: int, world: int) -> list[int]:
    """Ranks holding a page, spelled out independently of the layout table; `kind` an Ownership or its
    value ("replicated", "owner", "position")."""
    kind = getattr(kind, "value", kind)
    return {"replicated": list(range(world)), "owner": [owner], "position": [page % world]}[kind]


def build_plan(case, hist, kind: str, world: int, rank: int, seed: int) -> tuple[list[SeqSlice], KVPool]:
    """Page tables for every rank (ids handed out high to low so they never equal page indices) and
    this rank's pool: junk everywhere, then the cached histories where the tables put them."""
    nxt = [NUM_PAGES - 1] * world
    seqs = []
    for i, (start, num_new, owner) in enumerate(case):
        tables = [[-1] * (-(-(start + num_new) // P)) for _ in range(world)]
        for j in range(len(tables[0])):
            for r in holders(kind, j, owner, world):
                tables[r][j] = nxt[r]
                nxt[r] -= 1
        seqs.append(SeqSlice(req_id=100 + i, start=start, num_new=num_new, owner=owner, pages=tables,
                             sample=True))
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    pool = KVPool(CFG.num_hidden_layers, NUM_PAGES, P, D, DT)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g, dtype=DT) * 50)
    flat = pool.flat_layer(LAYER)
    for s, h in zip(seqs, hist):
        for p in range(s.start):
            page = s.pages[rank][p // P]
            if page >= 0:
                flat[page * P + p % P] = h[p]
    return seqs, pool


def reference(mla: MLA, case, q_in, latent_new, hist) -> torch.Tensor:
    """Causal absorbed-MLA attention written directly: softmax over every cached + new key."""
    positions = torch.tensor([p for s, n, _ in case for p in range(s, s + n)])
    q_lat, q_pe = mla.q_heads(q_in, positions)
    out = torch.empty_like(q_lat)
    row = 0
    for (start, n, _), h in zip(case, hist):
        r = slice(row, row + n)
        keys = torch.cat([h, latent_new[r]])  # positions 0 .. start+n-1
        c, k_pe = keys[:, :CFG.kv_lora_rank], keys[:, CFG.kv_lora_rank:]
        s = (torch.einsum("nhc,mc->nhm", q_lat[r], c) + torch.einsum("nhr,mr->nhm", q_pe[r], k_pe))
        s = s * mla.softmax_scale
        qpos = torch.arange(start, start + n)
        s = s.masked_fill((torch.arange(start + n)[None, :] > qpos[:, None])[:, None, :], float("-inf"))
        out[r] = torch.einsum("nhm,mc->nhc", torch.softmax(s, dim=-1), c)
        row += n
    return mla.out_heads(out)


def _expected_writes(seqs: list[SeqSlice], rank: int) -> dict[int, int]:
    """flat slot -> row for every new row this rank must store."""
    out, row = {}, 0
    for s in seqs:
        for i, p in enumerate(range(s.start, s.end)):
            page = s.pages[rank][p // P]
            if page >= 0:
                out[page * P + p % P] = row + i
        row += s.num_new
    return out


def run_layouts(comm, rank: int, world: int, names=NAMES, forms=FORMS) -> dict:
    """Every case x layout x attention form on this rank; checks the KV writes here, returns outputs and
    bytes, keyed (case, layout, form)."""
    results = {}
    for form in forms:
        results.update(_run_form(comm, rank, world, names, form))
    return results


def _run_form(comm, rank: int, world: int, names, form: str) -> dict:
    full = full_mla()
    results = {}
    for ci, (cname, case) in enumerate(cases(world).items()):
        q_in, latent_new, hist = inputs(case, seed=10 + ci)
        for li, name in enumerate(names):
            layout = make_layout(name, Kernels(KernelConfig(attention_form=form)))
            seqs, pool = build_plan(case, hist, layout.kv_ownership, world, rank, seed=77 + ci)
            before = pool.data.clone()
            ctx = build_context(seqs, kv=pool, layout=layout, comm=comm, rank=rank, world=world,
                                       page_size=P)
            mla = mla_for(full, layout.shards_projections, rank, world)
            comm.stats.begin_step(100 * ci + li)
            out = layout.attention(LAYER, mla, q_in, latent_new, ctx)
            # KV: exactly the new rows this rank stores changed, in layer LAYER only.
            changed = (pool.data != before).any(-1).view(CFG.num_hidden_layers, -1)
            want = _expected_writes(seqs, rank)
            assert not changed[0].any(), f"{name}: wrote into another layer"
            assert set(changed[LAYER].nonzero().flatten().tolist()) == set(want), f"{name}: wrong slots"
            for slot, row in want.items():
                assert torch.equal(pool.flat_layer(LAYER)[slot], latent_new[row]), f"{name}: slot {slot}"
            results[(cname, name, form)] = (out, dict(comm.stats.current))
    return results


def _rank_main(grid) -> dict:
    torch.manual_seed(0)
    return run_layouts(grid.comm, grid.rank, grid.world)


def _references(world: int) -> dict[str, torch.Tensor]:
    full = full_mla()
    refs = {}
    for ci, (cname, case) in enumerate(cases(world).items()):
        q_in, latent_new, hist = inputs(case, seed=10 + ci)
        refs[cname] = reference(full, case, q_in, latent_new, hist)
    return refs


def test_layouts_on_one_rank_match_reference() -> None:
    refs = _references(1)
    res = run_layouts(LocalCommunicator(), 0, 1, names=(*NAMES, "local"))
    assert {k[2] for k in res} == set(FORMS)
    for (cname, name, form), (out, _) in res.items():
        err = (out - refs[cname]).abs().max().item()
        assert err < 1e-12, f"{name}/{cname}/{form} at T=1: max error {err:.2e}"


def test_mha_form_in_bf16_is_as_close_as_the_absorbed_form() -> None:
    """bf16 (the serving dtype): both forms stay within rounding of the float64 attention, and the MHA
    form (keys and values decompressed in bf16, the flash kernel) is no further from it than absorbed."""
    case = [(0, 10, 0), (10, 1, 0), (14, 1, 0), (5, 6, 0)]
    q_in, latent_new, hist = inputs(case, seed=3)
    ref = reference(full_mla(), case, q_in, latent_new, hist)
    bf = full_mla().to(torch.bfloat16)
    err = {}
    for form in ("absorbed", "mha"):
        layout = make_layout("local", Kernels(KernelConfig(attention_form=form)))
        seqs, pool = build_plan(case, hist, "replicated", 1, 0, seed=5)
        pool.data, pool.dtype = pool.data.bfloat16(), torch.bfloat16
        ctx = build_context(seqs, kv=pool, layout=layout, comm=LocalCommunicator(), page_size=P)
        out = layout.attention(LAYER, bf, q_in.bfloat16(), latent_new.bfloat16(), ctx)
        assert out.dtype == torch.bfloat16
        err[form] = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err["absorbed"] < 0.05 and err["mha"] < 0.05, err
    assert err["mha"] < 1.5 * err["absorbed"], err


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_reference_on_gloo_ranks(world: int) -> None:
    per_rank = run_ranks(world, _rank_main, timeout=150)
    refs = _references(world)
    d, b = CFG.hidden_size, 8
    d_c, d_r = CFG.kv_lora_rank, CFG.qk_rope_head_dim
    for key, (out0, _) in per_rank[0].items():
        cname, name, form = key
        ref = refs[cname]
        n = ref.shape[0]
        for r in range(world):
            out, _ = per_rank[r][key]
            err = (out - ref).abs().max().item()
            assert err < 1e-12, f"{name}/{cname}/{form} T={world} rank {r}: max error {err:.2e}"
            assert torch.equal(out, out0), f"{name}/{cname}/{form}: ranks 0 and {r} disagree"
        if form != "absorbed":
            continue  # the byte counts below are the absorbed form's (the paper's formulas)
        # Bytes summed over ranks, by the convention of splash/distributed/stats.py.
        tot = {op: sum(per_rank[r][key][1].get((op, LAYER), 0) for r in range(world))
               for op in ("all_reduce", "all_gather", "all_to_all")}
        if name == "tp":
            assert tot == {"all_reduce": world * (2 * (world - 1) * n * d * b // world),
                           "all_gather": 0, "all_to_all": 0}
        elif name == "dp":
            assert tot == {"all_reduce": 0, "all_gather": n * d * b * (world - 1), "all_to_all": 0}
        elif name == "cp":
            # partials (latent + lse) of the other ranks' head slices out, merged slices gathered
            assert tot == {"all_reduce": 0, "all_to_all": (world - 1) * n * H * (d_c + 1) * b,
                           "all_gather": (world - 1) * n * H * d_c * b}
        elif name == "dop":
            v_dop = (1 - 1 / world) * n * H * ((d_c + d_r) + d_c) * b  # SPEC Eq 4
            assert tot["all_to_all"] == pytest.approx(v_dop, rel=0, abs=1e-6)
            assert eq4_bytes(n, H, d_c, d_r, world, b) == pytest.approx(v_dop)
            assert tot["all_reduce"] == world * (2 * (world - 1) * n * d * b // world)


# ---- the whole model: every layer through each layout on 2 ranks, two steps -----------------------
MODEL_STEPS = [  # per step: (request, num_new); request prompts are long enough for both steps
    [(0, 4), (1, 3), (2, 5)],  # prefill chunks of unequal length
    [(0, 3), (1, 1), (2, 1)],  # the rest of request 0's prompt + two decode rows
]
MODEL_OWNERS = [0, 1, 1]


def _model_run(path: str, layout_name: str, rank: int, world: int, comm) -> list[torch.Tensor]:
    """Logits of every row of every step of MODEL_STEPS, run through `layout_name`."""
    from splash.model.deepseek import DeepseekForCausalLM

    layout = make_layout(layout_name)
    model = DeepseekForCausalLM.from_pretrained(path, DT, rank, world, attn_sharded=layout.shards_projections)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 90, (8,), generator=g).tolist() for _ in MODEL_OWNERS]
    pool = KVPool(model.cfg.num_hidden_layers, 16, P, model.cfg.latent_dim, DT)
    nxt = [15] * world
    tables: dict[int, list[list[int]]] = {i: [[] for _ in range(world)] for i in range(len(ids))}
    cached = [0] * len(ids)
    out = []
    for step in MODEL_STEPS:
        seqs, tok = [], []
        for req, n in step:
            t = tables[req]
            while len(t[0]) < -(-(cached[req] + n) // P):
                j = len(t[0])
                held = holders(layout.kv_ownership, j, MODEL_OWNERS[req] % world, world)
                for r in range(world):
                    t[r].append(nxt[r] if r in held else -1)
                    nxt[r] -= r in held
            seqs.append(SeqSlice(req_id=req, start=cached[req], num_new=n, owner=MODEL_OWNERS[req] % world,
                                 pages=[list(x) for x in t], sample=True))
            tok += ids[req][cached[req]:cached[req] + n]
            cached[req] += n
        ctx = build_context(seqs, kv=pool, layout=layout, comm=comm, rank=rank, world=world,
                                   page_size=P)
        hidden = model(torch.tensor(tok), ctx.positions, ctx)
        out.append(model.compute_logits(hidden))
    return out


def _model_rank_main(grid, path: str) -> dict[str, list[torch.Tensor]]:
    return {name: _model_run(path, name, grid.rank, grid.world, grid.comm) for name in NAMES}


@pytest.mark.slow
def test_whole_model_through_each_layout_on_two_ranks(tmp_path) -> None:
    from helpers_ckpt import build_checkpoint

    path = build_checkpoint(tmp_path / "v3", "v3", seed=3)
    want = _model_run(path, "local", 0, 1, LocalCommunicator())
    per_rank = run_ranks(2, _model_rank_main, path, timeout=150)
    for r, res in enumerate(per_rank):
        for name, steps in res.items():
            for i, (got, ref) in enumerate(zip(steps, want)):
                err = (got - ref).abs().max().item()
                assert err < 1e-9, f"{name} rank {r} step {i}: logits differ by {err:.2e}"
