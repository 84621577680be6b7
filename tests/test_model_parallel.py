"""Fixed parallelism outside attention: dense MLP and shared experts tensor-parallel, routed experts
expert-parallel (or tensor-parallel), vocab-parallel embedding (and optionally LM head).

In process: each rank's share is exactly its slice of the single-rank model's weights (also from FP8
and fused-expert checkpoints), 1/T of the MLP/expert/embedding elements. On T = 2 and 4 gloo ranks:
the whole model through each attention layout, for a mixed prefill/decode batch, gives the
single-rank logits within 1e-9 (float64), with one all-reduce per MLP layer counted under "mlp.<i>".
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks
from helpers_ckpt import build_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file
from test_fp8_load import FP8
from test_fp8_load import ckpts as ckpts  # the FP8 / dequantised checkpoint pair fixture, reused

from splash.attention.registry import NAMES, make_layout
from splash.core.layouts import Ownership
from splash.core.model_config import ConfigError, ModelConfig
from splash.distributed.comm import LocalCommunicator
from splash.kv.pool import KVPool
from splash.model import DeepseekForCausalLM, load_model
from splash.model.shard import even_range
from splash.step.plan import SeqSlice
from splash.worker.context import build_context

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)
DT = torch.float64
SPLIT = ("mlp", "experts", "shared", "embed")  # what the fixed parallelism divides by T


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mp")
    return {"v3": build_checkpoint(root / "v3", "v3", seed=3),  # q_lora_rank, noaux_tc router
            "v2": build_checkpoint(root / "v2", "v2", seed=6)}  # no q_lora_rank, greedy softmax router


# ---- in process: what each rank holds ---------------------------------------------------------------
def _check_slices(full: DeepseekForCausalLM, part: DeepseekForCausalLM, rank: int, world: int) -> None:
    rows = even_range(full.cfg.vocab_size, rank, world)
    assert torch.equal(part.embed, full.embed[rows.start:rows.stop])
    assert torch.equal(part.lm_head, full.lm_head)  # replicated by default
    for lf, lp in zip(full.layers, part.layers):
        assert torch.equal(lp.self_attn.q_b, lf.self_attn.q_b)  # attention untouched (attn_sharded=False)
        mf, mp = lf.mlp, lp.mlp
        assert lp.mlp_partial
        if not lf.is_moe:
            c = mp.cols
            assert c == even_range(mf.inter, rank, world)
            assert torch.equal(mp.gate_proj, mf.gate_proj[c.start:c.stop])
            assert torch.equal(mp.up_proj, mf.up_proj[c.start:c.stop])
            assert torch.equal(mp.down_proj, mf.down_proj[:, c.start:c.stop])
            continue
        assert torch.equal(mp.gate.weight, mf.gate.weight)  # replicated router
        e, c, i = mp.experts, mp.cols, mf.inter
        if mp.mode == "ep":
            assert c == range(i) and e == even_range(mf.e, rank, world)
            assert torch.equal(mp.gate_up, mf.gate_up[e.start:e.stop])
            assert torch.equal(mp.down, mf.down[e.start:e.stop])
        else:
            assert e == range(mf.e) and c == even_range(i, rank, world)
            want = torch.cat([mf.gate_up[:, c.start:c.stop], mf.gate_up[:, i + c.start:i + c.stop]], dim=1)
            assert torch.equal(mp.gate_up, want)
            assert torch.equal(mp.down, mf.down[:, :, c.start:c.stop])
        s = mp.shared.cols
        assert torch.equal(mp.shared.gate_proj, mf.shared.gate_proj[s.start:s.stop])
        assert torch.equal(mp.shared.down_proj, mf.shared.down_proj[:, s.start:s.stop])


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_each_rank_holds_its_slice_and_a_tth_of_the_mlp(tiny, mode: str) -> None:
    full = load_model(tiny["v3"], DT)
    whole = full.weight_counts()
    assert not any(layer.mlp_partial for layer in full.layers)
    for world in (2, 4):
        counts = []
        for rank in range(world):
            part = load_model(tiny["v3"], DT, rank=rank, world=world, attn_sharded=False,
                              expert_parallel=mode)
            _check_slices(full, part, rank, world)
            counts.append(part.weight_counts())
        for k in whole:
            if k in SPLIT:  # every element once over the ranks, and 1/T each
                assert sum(c[k] for c in counts) == whole[k], k
                assert [c[k] for c in counts] == _shares(k, whole, world), (k, world)
            else:
                assert all(c[k] == whole[k] for c in counts), k


def _shares(part: str, whole: dict[str, int], world: int) -> list[int]:
    """Per-rank element counts of a split part: exact 1/T for the tiny MLP sizes; the 97-row
    vocabulary splits unevenly (49 + 48, 25 + 3 x 24)."""
    if part == "embed":
        return [len(even_range(97, r, world)) * 48 for r in range(world)]
    return [whole[part] // world] * world


def test_expert_parallelism_choice(tmp_path) -> None:
    from helpers_ckpt import hf_config

    hf_config("v3").save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    kw = dict(attn_sharded=False, device="meta")
    assert DeepseekForCausalLM(cfg, DT, 0, 2, **kw).layers[1].mlp.mode == "ep"
    # 32 experts over 3 ranks: each expert's intermediate size (24) is split instead
    m = DeepseekForCausalLM(cfg, DT, 2, 3, **kw).layers[1].mlp
    assert m.mode == "tp" and m.experts == range(32) and m.cols == range(16, 24)
    with pytest.raises(ConfigError, match="cannot be split evenly over 3 ranks"):
        DeepseekForCausalLM(cfg, DT, 0, 3, expert_parallel="ep", **kw)
    with pytest.raises(ConfigError, match="choose one of"):
        DeepseekForCausalLM(cfg, DT, 0, 2, expert_parallel="bogus", **kw)
    # uneven dense split over 3 ranks: 80 = 27 + 27 + 26
    sizes = [len(DeepseekForCausalLM(cfg, DT, r, 3, **kw).layers[0].mlp.cols) for r in range(3)]
    assert sizes == [27, 27, 26]


def test_vocab_parallel_head_needs_a_communicator(tiny) -> None:
    part = load_model(tiny["v3"], DT, rank=1, world=2, shard_lm_head=True)
    assert part.lm_head.shape[0] == len(even_range(97, 1, 2))
    with pytest.raises(RuntimeError, match="every rank must call compute_logits"):
        part.compute_logits(torch.zeros(1, part.cfg.hidden_size, dtype=DT))


def test_fused_expert_checkpoint_loads_sharded(tiny, tmp_path) -> None:
    """transformers-5's stacked experts ([E, 2I, d] gate then up, [E, d, I]) give the same slices."""
    src = tiny["v3"]
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        ts = {k: f.get_tensor(k) for k in f.keys()}
    cfg = ModelConfig.from_hf(src)
    for li in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(li):
            continue
        p = f"model.layers.{li}.mlp.experts"
        e = range(cfg.n_routed_experts)
        gate = [ts.pop(f"{p}.{j}.gate_proj.weight") for j in e]
        up = [ts.pop(f"{p}.{j}.up_proj.weight") for j in e]
        ts[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        ts[f"{p}.down_proj"] = torch.stack([ts.pop(f"{p}.{j}.down_proj.weight") for j in e])
    save_file(ts, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    for mode in ("ep", "tp"):
        for rank in range(2):
            a = load_model(src, DT, rank=rank, world=2, expert_parallel=mode).state_dict()
            b = load_model(str(tmp_path), DT, rank=rank, world=2, expert_parallel=mode).state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (mode, rank)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_fp8_mlp_slices_cross_block_edges(ckpts) -> None:
    """FP8 block-scaled MLP/expert weights read as slices (the dense intermediate size 272 splits at
    136 and 68, inside a 128-block) equal the same slices of the dequantised checkpoint."""
    _, fp8, deq = ckpts
    for world, mode in ((2, "ep"), (4, "tp")):
        for rank in range(world):
            a = load_model(fp8, DT, rank=rank, world=world, attn_sharded=False, expert_parallel=mode)
            b = load_model(deq, DT, rank=rank, world=world, attn_sharded=False, expert_parallel=mode)
            assert a.layers[0].mlp.cols == even_range(272, rank, world)
            sa, sb = a.state_dict(), b.state_dict()
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), (world, rank)


# ---- on gloo ranks: the whole model through each layout ---------------------------------------------
P = 4
PROMPT = 9
OWNERS = [0, 1, 3, 1]  # % world: at T = 4 rank 2 owns no request
# (request, new rows) per step: prefill chunks; the rest of two prompts + decodes; decodes only
STEPS = [
    [(0, 5), (1, 3), (2, 4), (3, 1)],
    [(0, 4), (1, 1), (2, 5), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


def _holders(layout, page: int, owner: int, world: int) -> list[int]:
    """Ranks holding a page under the layout's KV ownership, spelled out here independently of the table."""
    return {Ownership.REPLICATED: list(range(world)), Ownership.OWNER: [owner],
            Ownership.POSITION: [page % world]}[layout.kv_ownership]


def run_steps(model: DeepseekForCausalLM, layout, rank: int, world: int, comm) -> tuple[list, dict]:
    """Logits of every row of every step in STEPS, and the comm bytes of the last step."""
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 90, (PROMPT + 2,), generator=g).tolist() for _ in OWNERS]
    pool = KVPool(model.cfg.num_hidden_layers, 24, P, model.cfg.latent_dim, DT)
    nxt = [23] * world
    tables = [[[] for _ in range(world)] for _ in OWNERS]
    cached = [0] * len(OWNERS)
    out = []
    for si, step in enumerate(STEPS):
        seqs, tok = [], []
        for req, n in step:
            t, owner = tables[req], OWNERS[req] % world
            while len(t[0]) < -(-(cached[req] + n) // P):
                held = _holders(layout, len(t[0]), owner, world)
                for r in range(world):
                    t[r].append(nxt[r] if r in held else -1)
                    nxt[r] -= r in held
            seqs.append(SeqSlice(req_id=req, start=cached[req], num_new=n, owner=owner,
                                 pages=[list(x) for x in t], sample=True))
            tok += ids[req][cached[req]:cached[req] + n]
            cached[req] += n
        ctx = build_context(seqs, kv=pool, layout=layout, comm=comm, rank=rank, world=world,
                                   page_size=P)
        comm.stats.begin_step(si)
        hidden = model(torch.tensor(tok), ctx.positions, ctx)
        out.append(model.compute_logits(hidden, comm))
    return out, dict(comm.stats.current)


def _rank_main(grid, paths: dict[str, str]) -> dict:
    rank, world, comm = grid.rank, grid.world, grid.comm
    res: dict = {}
    for kind, path in paths.items():
        models = {s: load_model(path, DT, rank=rank, world=world, attn_sharded=s) for s in (True, False)}
        res[(kind, "counts")] = models[True].weight_counts()
        for name in NAMES:
            layout = make_layout(name)
            res[(kind, name)] = run_steps(models[layout.shards_projections], layout, rank, world, comm)
    # the other expert parallelism, and the vocab-parallel LM head (a collective compute_logits)
    m = load_model(paths["v3"], DT, rank=rank, world=world, attn_sharded=True, expert_parallel="tp",
                   shard_lm_head=True)
    res[("v3", "dop+tp-experts+vocab-head")] = run_steps(m, make_layout("dop"), rank, world, comm)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_whole_model_on_ranks_matches_single_rank(tiny, world: int) -> None:
    per_rank = run_ranks(world, _rank_main, tiny, timeout=240)
    d, b = 48, 8
    for kind, path in tiny.items():
        full = load_model(path, DT)
        want, _ = run_steps(full, make_layout("local"), 0, 1, LocalCommunicator())
        whole = full.weight_counts()
        for k in SPLIT:
            assert [per_rank[r][(kind, "counts")][k] for r in range(world)] == _shares(k, whole, world), k
        names = [n for (k, n) in per_rank[0] if k == kind and n != "counts"]
        assert len(names) == len(NAMES) + (kind == "v3")
        for name in names:
            for r in range(world):
                steps, stats = per_rank[r][(kind, name)]
                for i, (x, ref) in enumerate(zip(steps, want)):
                    err = (x - ref).abs().max().item()
                    assert err < 1e-9, f"{kind}/{name} T={world} rank {r} step {i}: logits off by {err:.2e}"
                    assert torch.equal(x.argmax(-1), ref.argmax(-1)), f"{kind}/{name}: greedy tokens differ"
                # last step: N decode rows, one MLP all-reduce per layer, one for the embedding
                n = sum(k for _, k in STEPS[-1])
                ar = 2 * (world - 1) * n * d * b // world
                for li in range(full.cfg.num_hidden_layers):
                    assert stats[("all_reduce", f"mlp.{li}")] == ar, (name, li, stats)
                assert stats[("all_reduce", "embed")] == ar
                if "vocab-head" in name:
                    assert stats[("all_gather", "lm_head")] == (world - 1) * n * -(-97 // world) * b
