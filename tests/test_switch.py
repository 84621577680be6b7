"""Live layout switches (splash/switch) on real gloo ranks give the unswitched single-rank answer.

A tiny float64 DeepSeek-V3 checkpoint (transformers-made) runs a fixed schedule of chunked prefills
and decodes through a minimal leader/worker loop written here: rank 0 owns the page allocators,
plans each step and (at the switching step) the switch, and broadcasts both; every rank runs the
model. The switch happens during step 2, with one request mid-prefill, one finishing its prefill,
one arriving and one holding pages without rows in that step. Checked for every case: logits of
every sampled row on every rank within 1e-9 of the unswitched single-rank run, identical greedy
tokens (which match transformers' greedy decoding), page accounting balanced on every rank after
every step (no leak, no double allocation, tables follow the running layout's placement rule),
bytes counted per layer equal to the analytical core's manifest, overlapped and blocking modes
bit-identical, at most one layer in transit, and a switch refused for memory leaving the
allocators untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from dist_utils import run_ranks

from splash.attention.registry import make_layout
from splash.core.manifest import switch_manifest
from splash.core.model_config import ModelConfig
from splash.distributed.comm import LocalCommunicator
from splash.kv.allocator import KVAllocator, page_ranks
from splash.kv.pool import KVPool
from splash.step.plan import LAYOUTS, SeqSlice, StepPlan
from splash.switch import LiveRequest, SwitchExecutor, SwitchLayout, SwitchPlan, SwitchPlanner, SwitchRefusal
from splash.switch.executor import WEIGHT_KEYS
from splash.worker.context import build_context

pytestmark = pytest.mark.timeout(300)

DT = torch.float64
P = 4
NUM_PAGES = 40
SWITCH_STEP = 2
DIRECTIONS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]


# ---- the schedule --------------------------------------------------------------------------------
@dataclass
class Req:
    rid: int
    ids: list[int]
    prompt: int
    owner: int
    pages: list[list[int]] = field(default_factory=list)
    cached: int = 0
    generated: list[int] = field(default_factory=list)


def scenario(name: str, world: int) -> tuple[list[Req], list[list[tuple[int, int]]]]:
    """Requests (prompt ids, source owner) and per step the (request, rows) scheduled.

    "mixed": 5 requests; at the switch step r1 holds pages but has no rows, r2 finishes its prefill,
    r3 is mid-prefill and r4 arrives (no history yet). "few": 2 requests both owned by the last
    rank (other ranks own nothing)."""
    g = torch.Generator().manual_seed(11)
    if name == "mixed":
        prompts, owners = [11, 7, 14, 9, 5], [0, 1, 1, 3, 0]
        sched = [[(0, 6), (1, 7), (2, 5)],
                 [(0, 5), (1, 1), (2, 5), (3, 3)],
                 [(0, 1), (2, 4), (3, 3), (4, 5)],
                 [(0, 1), (1, 1), (2, 1), (3, 3), (4, 1)],
                 [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]]
    elif name == "few":
        prompts, owners = [10, 6], [world - 1, world - 1]
        sched = [[(0, 4), (1, 6)], [(0, 4), (1, 1)], [(0, 2), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    else:
        raise ValueError(name)
    reqs = [Req(i, torch.randint(3, 90, (n,), generator=g).tolist(), n, o % world)
            for i, (n, o) in enumerate(zip(prompts, owners))]
    return reqs, sched


def accounting_errors(alloc: KVAllocator, reqs: list[Req]) -> list[str]:
    """Every used page is in exactly one table entry, and the tables follow the running placement."""
    errs = []
    for r, a in enumerate(alloc.ranks):
        held = [p for q in reqs if q.pages for p in q.pages[r] if p >= 0]
        used = {p for p in range(a.num_pages) if a._used[p]}
        if len(held) != len(set(held)):
            errs.append(f"rank {r}: a page is in two table entries")
        if used != set(held):
            errs.append(f"rank {r}: leaked {sorted(used - set(held))}, "
                        f"unallocated {sorted(set(held) - used)}")
        if a.num_free + len(used) != a.num_pages:
            errs.append(f"rank {r}: free list and used marks disagree")
    for q in reqs:
        for j in range(len(q.pages[0]) if q.pages else 0):
            want = set(page_ranks(alloc.layout, j, q.owner, alloc.world))
            got = {r for r in range(alloc.world) if q.pages[r][j] >= 0}
            if want != got:
                errs.append(f"request {q.rid} page {j}: held by {sorted(got)}, "
                            f"{alloc.layout} says {sorted(want)}")
    return errs


def snapshot(alloc: KVAllocator) -> tuple:
    return alloc.layout, [list(a._free) for a in alloc.ranks], [list(a._used) for a in alloc.ranks]


# ---- the model on one rank -----------------------------------------------------------------------
def forward(model, pool, comm, rank: int, world: int, plan: StepPlan, layout) -> torch.Tensor:
    ctx = build_context(plan.seqs, kv=pool, layout=layout, comm=comm, rank=rank, world=world,
                               page_size=P)
    hidden = model(torch.tensor(plan.input_ids), ctx.positions, ctx)
    return model.compute_logits(hidden[plan.sample_rows()])


def drive(model, pool, comm, switch_comm, rank: int, world: int, src: str, run_as: str, scen: str,
          dst: str | tuple[str, ...] | None = None, mode: str = "overlapped", pages: int = NUM_PAGES) -> dict:
    """Run the schedule; switch to `dst` during SWITCH_STEP (a tuple: one switch per step from
    SWITCH_STEP on). Rank 0 plans; every rank computes."""
    dsts = (dst,) if isinstance(dst, str) else tuple(dst or ())
    reqs, sched = scenario(scen, world)
    leader = rank == 0
    alloc = KVAllocator(pages, P, world, layout=src) if leader else None
    planner = SwitchPlanner(model.cfg, alloc, DT) if leader else None
    layout = make_layout(run_as)
    out: dict = {"logits": [], "errors": [], "switches": [], "refusal": None}
    for step, work in enumerate(sched):
        msg = None
        if leader:
            slices, ids = [], []
            for rid, n in work:
                q = reqs[rid]
                assert 0 < n <= len(q.ids) - q.cached, "schedule asks for tokens that do not exist yet"
                alloc.grow(q.pages, q.cached + n, q.owner)
                slices.append(SeqSlice(rid, q.cached, n, q.owner, [row[:] for row in q.pages],
                                       sample=q.cached + n == len(q.ids)))
                ids += q.ids[q.cached:q.cached + n]
            plan = StepPlan(step, alloc.layout, ids, slices)
            sw = refusal = None
            if 0 <= step - SWITCH_STEP < len(dsts):
                rows = dict(work)
                live = [LiveRequest(q.rid, q.cached, q.owner, [row[:] for row in q.pages],
                                    tokens=q.cached + rows.get(q.rid, 0), projected=q.prompt + 4)
                        for q in reqs if q.pages and q.pages[0]]
                before = snapshot(alloc)
                res = planner.plan(dsts[step - SWITCH_STEP], live, mode)
                if isinstance(res, SwitchRefusal):
                    refusal = res
                    if snapshot(alloc) != before:
                        out["errors"].append(f"step {step}: a refused switch changed the allocators")
                else:
                    sw = res
                    plan = sw.restep(plan)
            plan.validate(P, world)
            msg = (plan, sw, refusal)
        plan, sw, refusal = comm.broadcast_object(msg)
        comm.stats.begin_step(step)
        if sw is not None:
            ex = SwitchExecutor(sw, model, pool, switch_comm, poison_freed=True)
            new_layout = make_layout(sw.dst)
            ex.start()
            logits = forward(model, pool, comm, rank, world, plan, SwitchLayout(ex, new_layout))
            result = ex.finish()
            layout = new_layout
            measured = {k: b for k, b in comm.stats.current.items() if str(k[1]).startswith("switch.")}
            out["switches"].append({"plan": sw, "result": result, "bytes": measured})
            if leader:
                planner.commit(sw, result.freed)
                for q in reqs:
                    if q.rid in sw.tables:
                        q.pages, q.owner = sw.tables[q.rid], sw.owners[q.rid]
        else:
            logits = forward(model, pool, comm, rank, world, plan, layout)
        out["logits"].append(logits)
        if refusal is not None:
            out["refusal"] = refusal
        if leader:
            at = 0
            for s in plan.seqs:
                q = reqs[s.req_id]
                q.cached += s.num_new
                if s.sample:
                    tok = int(logits[at].argmax())
                    q.ids.append(tok)
                    q.generated.append(tok)
                    at += 1
            out["errors"] += [f"step {step}: {e}" for e in accounting_errors(alloc, reqs)]
            out["tokens"] = {q.rid: q.generated for q in reqs}
            out["layout"] = alloc.layout
    return out


def full_blocks(model) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in layer.self_attn.head_tensors().items()} for layer in model.layers]


def set_layout_heads(model, blocks, layout: str, rank: int, world: int) -> None:
    """Put the model's attention projections in `layout`'s placement (from the full blocks)."""
    H = model.cfg.num_attention_heads
    per = H // world
    heads = range(rank * per, (rank + 1) * per) if layout in ("tp", "dop") and world > 1 else range(H)
    for layer, full in zip(model.layers, blocks):
        sub = {k: (v[:, heads.start:heads.stop] if k == "o" else v[heads.start:heads.stop]).clone()
               for k, v in full.items()}
        layer.self_attn.set_heads(heads, sub)
    model.attn_sharded = layout in ("tp", "dop") and world > 1


def _rank_cases(grid, path: str, cases: list[tuple]) -> dict:
    """Every case on this rank, one model load: (src, dst, mode, scenario, pages) -> drive()'s output."""
    from splash.model.deepseek import DeepseekForCausalLM

    torch.manual_seed(0)
    model = DeepseekForCausalLM.from_pretrained(path, DT, grid.rank, grid.world, attn_sharded=False)
    blocks = full_blocks(model)
    cfg = model.cfg
    pool = KVPool.for_model(cfg, NUM_PAGES, P, DT)
    g = torch.Generator().manual_seed(100 + grid.rank)
    junk = [torch.randn(t.shape, generator=g, dtype=DT) * 50 for t in pool.tensors()]
    out = {}
    for case in cases:
        src, dst, mode, scen, pages = case
        set_layout_heads(model, blocks, src, grid.rank, grid.world)
        for t, j in zip(pool.tensors(), junk):  # stale junk in every store: a wrong page read shows
            t.copy_(j)
        out[case] = drive(model, pool, grid.comm, grid.switch, grid.rank, grid.world, src, src, scen,
                          dst, mode, pages)
    return out


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from helpers_ckpt import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("switch") / "v3", "v3", seed=5)


@pytest.fixture(scope="module")
def reference(ckpt) -> dict[str, dict]:
    return _reference(ckpt)


@pytest.fixture(scope="module")
def dsa_ckpt(tmp_path_factory) -> str:
    """GLM-5's shape: layers 0 and 2 with an indexer, layer 1 sharing its top-k (no index keys there);
    top-k 4, well below the schedule's contexts."""
    from helpers_dsa import build_dsa_checkpoint

    return build_dsa_checkpoint(tmp_path_factory.mktemp("switch-dsa") / "glm", "glm", seed=5, index_topk=4,
                                index_head_dim=48)


@pytest.fixture(scope="module")
def dsa_reference(dsa_ckpt) -> dict[str, dict]:
    return _reference(dsa_ckpt)


def _reference(ckpt: str) -> dict[str, dict]:
    """The unswitched single-rank run of each scenario (local layout), and transformers' greedy tokens."""
    from helpers_ckpt import hf_reference

    from splash.model.deepseek import DeepseekForCausalLM

    model = DeepseekForCausalLM.from_pretrained(ckpt, DT, 0, 1)
    hf = hf_reference(ckpt)
    refs = {}
    # One thread, as every rank runs here: the router's float32 GEMM rounds differently with two threads
    # (~1e-7 in the routing weights), which is not what these tests are about.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for scen in ("mixed", "few"):
            refs[scen] = _reference_run(model, hf, scen)
    finally:
        torch.set_num_threads(threads)
    return refs


def _reference_run(model, hf, scen: str) -> dict:
    from helpers_ckpt import hf_greedy

    pool = KVPool.for_model(model.cfg, NUM_PAGES, P, DT)
    comm = LocalCommunicator()
    ref = drive(model, pool, comm, comm, 0, 1, "tp", "local", scen)
    reqs, _ = scenario(scen, 1)
    for q in reqs:
        gen = ref["tokens"][q.rid]
        assert gen == hf_greedy(hf, q.ids, len(gen)), f"{scen}: request {q.rid} differs from transformers"
    return ref


# ---- checks ------------------------------------------------------------------------------------------
def check_case(case: tuple, per_rank: list[dict], ref: dict, world: int, cfg: ModelConfig) -> None:
    src, dst, mode, scen, _ = case
    dsts = (dst,) if isinstance(dst, str) else dst
    name = f"{src}->{'->'.join(dsts)} {mode} {scen} T={world}"
    lead = per_rank[0]
    assert not lead["errors"], f"{name}: {lead['errors']}"
    assert lead["tokens"] == ref["tokens"], f"{name}: greedy tokens differ"
    for r, res in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(res["logits"], ref["logits"], strict=True)):
            err = (got - want).abs().max().item() if got.numel() else 0.0
            assert err < 1e-9, f"{name}: rank {r} step {step} logits differ by {err:.2e}"
    assert lead["layout"] == dsts[-1] and len(lead["switches"]) == len(dsts)
    for k, at in enumerate(lead["switches"]):
        sw: SwitchPlan = at["plan"]
        assert (sw.src, sw.dst) == ((src,) + tuple(dsts))[k:k + 2]
        # The plan's bytes are the analytical core's, and every rank sent exactly them, layer by layer.
        man = switch_manifest(cfg, sw.src, sw.dst, sw.batch, world, P, "fp64", "fp64")
        for r, res in enumerate(per_rank):
            meas = res["switches"][k]["bytes"]
            for lay in sw.layers:
                i = lay.layer
                w = meas.get(("all_gather", f"switch.w.{i}"), 0)
                kv = meas.get(("all_to_all", f"switch.kv.{i}"), 0)
                assert w == lay.weight_send_bytes[r] == man.weights.send_bytes[r], f"{name}: r{r} layer {i} W"
                # each layer's own KV: the latent, and the indexer's keys where the layer has an indexer
                want = man.kv_layer(i).send_bytes[r]
                assert kv == lay.kv_send_bytes[r] == want, f"{name}: r{r} layer {i} KV"
            assert set(meas) <= {(op, f"switch.{kind}.{i}") for op, kind in (("all_gather", "w"),
                                 ("all_to_all", "kv")) for i in range(cfg.num_hidden_layers)}, \
                f"{name}: unexpected switch traffic"
            result = res["switches"][k]["result"]
            assert result.freed == sw.frees[r]
            if mode == "overlapped":
                assert result.max_in_flight == 1, f"{name}: {result.max_in_flight} layers in transit at once"


def check_modes_agree(results: dict) -> None:
    for (src, dst, mode, scen, pages), per_rank in results.items():
        if mode != "overlapped":
            continue
        other = results.get((src, dst, "blocking", scen, pages))
        if other is None:
            continue
        for r in range(len(per_rank)):
            for a, b in zip(per_rank[r]["logits"], other[r]["logits"], strict=True):
                assert torch.equal(a, b), f"{src}->{dst} {scen}: overlapped and blocking differ on rank {r}"


def run_world(world: int, ckpt: str, reference: dict, cases: list[tuple]) -> dict:
    from splash.core.model_config import ModelConfig

    per_rank = run_ranks(world, _rank_cases, ckpt, cases, timeout=240)
    cfg = ModelConfig.from_hf(ckpt)
    results = {c: [per_rank[r][c] for r in range(world)] for c in cases}
    for case, res in results.items():
        if case[4] == NUM_PAGES:
            check_case(case, res, reference[case[3]], world, cfg)
    check_modes_agree(results)
    return results


# ---- multi-rank tests --------------------------------------------------------------------------------
TIGHT = 10  # pages per rank: enough for the mixed schedule in DP at T = 2, not for TP's replicas


@pytest.mark.slow
def test_all_directions_on_two_ranks(ckpt, reference) -> None:
    cases = [(a, b, m, "mixed", NUM_PAGES) for a, b in DIRECTIONS for m in ("overlapped", "blocking")]
    cases += [(a, b, "overlapped", "few", NUM_PAGES) for a, b in
              [("tp", "dp"), ("cp", "dop"), ("dop", "cp"), ("dp", "tp")]]
    # three switches in consecutive steps (dop -> cp -> tp -> dp)
    cases += [("dop", ("cp", "tp", "dp"), m, "mixed", NUM_PAGES) for m in ("overlapped", "blocking")]
    refused = ("dp", "tp", "overlapped", "mixed", TIGHT)
    results = run_world(2, ckpt, reference, cases + [refused])
    # A switch refused for memory: nothing changed, the step and the rest ran in DP, same answer.
    lead = results[refused][0]
    assert isinstance(lead["refusal"], SwitchRefusal) and lead["refusal"].reason == "eq5", lead["refusal"]
    assert lead["switches"] == [] and lead["layout"] == "dp"
    assert not lead["errors"], lead["errors"]
    assert lead["tokens"] == reference["mixed"]["tokens"]
    for r, res in enumerate(results[refused]):
        for got, want in zip(res["logits"], reference["mixed"]["logits"], strict=True):
            assert (got - want).abs().max().item() < 1e-9, f"refused switch: rank {r} logits differ"


@pytest.mark.slow
def test_directions_on_four_ranks(ckpt, reference) -> None:
    # Every primitive: weights all-gather (tp->cp, dop->dp) / slice (cp->tp, cp->dop) / keep;
    # KV all-gather (cp->tp, dop->tp), all-to-all (dp->cp, cp->dop), discard (tp->cp, dop->dp, tp->dop).
    dirs = [("tp", "cp"), ("dop", "dp"), ("cp", "tp"), ("dp", "cp"), ("cp", "dop"), ("dop", "tp")]
    cases = [(a, b, m, "mixed", NUM_PAGES) for a, b in dirs for m in ("overlapped", "blocking")]
    cases += [(a, b, "overlapped", "few", NUM_PAGES) for a, b in [("tp", "dop"), ("cp", "dp")]]
    run_world(4, ckpt, reference, cases)


@pytest.mark.slow
def test_dsa_directions_move_the_indexer_keys(dsa_ckpt, dsa_reference) -> None:
    """A DSA model (GLM-5's shape: a shared layer without index keys): every KV primitive and both modes
    at T = 2 and the weight all-gather/slice at T = 4; the executor sends each layer's latent and indexer
    keys together, exactly the manifest's bytes of that layer (the shared layer's smaller)."""
    from splash.core.sizes import AttentionSizes

    sizes = AttentionSizes(ModelConfig.from_hf(dsa_ckpt), "fp64", "fp64")
    assert sizes.kv_token_bytes(0) > sizes.kv_token_bytes(1)  # the shared layer holds no indexer keys
    dirs = [("tp", "cp"), ("cp", "tp"), ("dp", "dop"), ("dop", "tp"), ("cp", "dop"), ("dp", "cp")]
    cases = [(a, b, m, "mixed", NUM_PAGES) for a, b in dirs for m in ("overlapped", "blocking")]
    cases += [("dop", ("cp", "tp", "dp"), "overlapped", "mixed", NUM_PAGES),
              ("tp", "dop", "overlapped", "few", NUM_PAGES)]
    run_world(2, dsa_ckpt, dsa_reference, cases)
    run_world(4, dsa_ckpt, dsa_reference, [("tp", "dp", "overlapped", "mixed", NUM_PAGES),
                                           ("cp", "dop", "blocking", "mixed", NUM_PAGES)])


# ---- the planner alone (rank 0's bookkeeping; no ranks) -----------------------------------------------
def _tiny_cfg() -> ModelConfig:
    from splash.core.presets import PRESETS

    return PRESETS["tiny"]


def _grown(cfg: ModelConfig, src: str, world: int, lens: list[tuple[int, int]], pages: int = 64
           ) -> tuple[KVAllocator, list[LiveRequest]]:
    """An allocator in `src` with requests grown to (context, tokens), owners round-robin."""
    alloc = KVAllocator(pages, P, world, layout=src)
    live = []
    for i, (ctx_len, tokens) in enumerate(lens):
        table: list[list[int]] = []
        alloc.grow(table, tokens, i % world)
        live.append(LiveRequest(i, ctx_len, i % world, table, tokens=tokens))
    return alloc, live


LENS = [(13, 14), (5, 9), (0, 3), (22, 22), (8, 8), (1, 2)]


@pytest.mark.parametrize("world", [2, 4])
def test_planner_tables_bytes_and_accounting(world: int) -> None:
    cfg = _tiny_cfg()
    for src, dst in DIRECTIONS:
        alloc, live = _grown(cfg, src, world, LENS)
        planner = SwitchPlanner(cfg, alloc, "bf16")
        used_before = alloc.num_used
        plan = planner.plan(dst, live)
        assert isinstance(plan, SwitchPlan), plan
        man = switch_manifest(cfg, src, dst, plan.batch, world, P, "bf16")
        per_tok = cfg.latent_dim * 2
        wire = plan.for_ranks()  # what the switching step carries: the executor's part, none of rank 0's
        for r in range(world):
            assert sum(plan.kv_send_tokens(r)) * per_tok == man.kv.send_bytes[r]
            assert sum(wire.kv_recv_tokens(r)) * per_tok == man.kv.recv_bytes[r]
        assert (wire.frees, wire.src_heads, wire.dst_heads, wire.weight_op) == \
            (plan.frees, plan.src_heads, plan.dst_heads, plan.weight_op)
        assert wire.tables == {} and wire.headroom is None and plan.tables and plan.headroom is not None
        for q in live:
            t = plan.tables[q.req_id]
            for j in range(len(t[0])):
                for r in range(world):
                    held = r in page_ranks(dst, j, plan.owners[q.req_id], world)
                    assert (t[r][j] >= 0) == held
                    if held and j < len(q.pages[r]) and q.pages[r][j] >= 0:
                        assert t[r][j] == q.pages[r][j], "a page the rank already holds must be kept"
        planner.commit(plan)
        assert alloc.layout == dst
        assert alloc.num_used == [u + len(a) - len(f) for u, a, f in
                                  zip(used_before, plan.allocated, plan.frees)]
        reqs = [Req(q.req_id, [], 0, plan.owners[q.req_id], plan.tables[q.req_id]) for q in live]
        assert accounting_errors(alloc, reqs) == [], f"{src}->{dst}"
        with pytest.raises(RuntimeError, match="not pending"):
            planner.commit(plan)


def test_planner_rejects_inconsistent_input() -> None:
    cfg = _tiny_cfg()
    alloc, live = _grown(cfg, "dp", 2, LENS)
    planner = SwitchPlanner(cfg, alloc)
    with pytest.raises(ValueError, match="every request that holds pages"):
        planner.plan("cp", live[1:])
    with pytest.raises(ValueError, match="already running"):
        planner.plan("dp", live)
    with pytest.raises(ValueError, match="unknown destination"):
        planner.plan("pp", live)
    live[0].context = 99
    with pytest.raises(ValueError, match="context"):
        planner.plan("cp", live)
    assert planner.pending == {} and alloc.layout == "dp"


def test_planner_abort_restores_allocators() -> None:
    cfg = _tiny_cfg()
    for src, dst in DIRECTIONS:
        alloc, live = _grown(cfg, src, 2, LENS)
        before = alloc.num_free, [sorted(a._free) for a in alloc.ranks], alloc.layout
        planner = SwitchPlanner(cfg, alloc)
        plan = planner.plan(dst, live)
        assert isinstance(plan, SwitchPlan)
        planner.abort(plan)
        assert (alloc.num_free, [sorted(a._free) for a in alloc.ranks], alloc.layout) == before


def test_planner_refuses_what_does_not_fit() -> None:
    cfg = _tiny_cfg()
    # DP -> TP replicates every history on every rank: with 9 pages per rank it cannot fit (Eq 5).
    alloc, live = _grown(cfg, "dp", 2, [(20, 20), (20, 20)], pages=9)
    snap = snapshot(alloc)
    res = SwitchPlanner(cfg, alloc).plan("tp", live)
    assert isinstance(res, SwitchRefusal) and res.reason == "eq5", res
    assert "rank" in str(res) and res.headroom.new_pages == [5, 5]
    assert snapshot(alloc) == snap
    # Eq 6: fits now, but not with the requests' projected growth.
    alloc, live = _grown(cfg, "dp", 2, [(8, 8), (8, 8)], pages=6)
    for q in live:
        q.projected = 40
    res = SwitchPlanner(cfg, alloc).plan("cp", live)
    assert isinstance(res, SwitchRefusal) and res.reason == "eq6", res
    # Weights: TP -> DP gathers replicas; no room beside the pool for them.
    alloc, live = _grown(cfg, "tp", 2, [(8, 8)])
    res = SwitchPlanner(cfg, alloc, weight_headroom_bytes=1000.0).plan("dp", live)
    assert isinstance(res, SwitchRefusal) and res.reason == "weights", res
    assert snapshot(alloc)[0] == "tp"


def test_planner_balances_owners_from_tp() -> None:
    cfg = _tiny_cfg()
    lens = [(60, 60), (50, 50), (40, 40), (30, 30), (20, 20), (10, 10), (5, 5), (5, 5)]
    alloc, live = _grown(cfg, "tp", 4, lens, pages=128)
    plan = SwitchPlanner(cfg, alloc).plan("dop", live)
    assert isinstance(plan, SwitchPlan)
    load = [0] * 4
    for q in live:
        load[plan.owners[q.req_id]] += -(-q.end // P)
    assert max(load) - min(load) <= -(-60 // P) // 2, load  # LPT: within half the largest request
    assert plan.headroom.new_pages == [0, 0, 0, 0]  # TP held everything: a pure discard
    # DP -> DOP keeps owners (a discard); fewer requests than ranks leaves ranks owning nothing.
    alloc, live = _grown(cfg, "dp", 4, [(9, 9), (3, 4)])
    plan = SwitchPlanner(cfg, alloc).plan("dop", live)
    assert isinstance(plan, SwitchPlan) and plan.owners == {0: 0, 1: 1} and not plan.moves_kv


def test_switch_executor_on_one_rank_is_a_noop_switch() -> None:
    """T = 1: every switch is a keep; the executor protocol still runs (start/before_layer/finish)."""
    from splash.model.deepseek import DeepseekForCausalLM

    model = DeepseekForCausalLM(_tiny_cfg(), DT, 0, 1, attn_sharded=False)
    pool = KVPool(model.cfg.num_hidden_layers, 4, P, model.cfg.latent_dim, DT)
    alloc, live = _grown(model.cfg, "dp", 1, [(5, 6)], pages=4)
    plan = SwitchPlanner(model.cfg, alloc, DT).plan("cp", live)
    assert isinstance(plan, SwitchPlan) and plan.weight_op == "keep" and not plan.moves_kv
    ex = SwitchExecutor(plan, model, pool, LocalCommunicator())
    with pytest.raises(RuntimeError, match="start"):
        ex.before_layer(0)
    ex.start()
    with pytest.raises(RuntimeError, match="in order"):
        ex.before_layer(1)
    for i in range(model.cfg.num_hidden_layers):
        ex.before_layer(i)
    assert ex.finish().freed == []
    assert set(WEIGHT_KEYS) == set(model.layers[0].self_attn.head_tensors())


def test_corrupt_manifest_page_ids_give_the_clear_error_not_an_index_error() -> None:
    """A move or free naming a page past the request's table is the core/placement disagreement
    error (with the request named), never a bare IndexError from numpy."""
    import numpy as np

    from splash.core.manifest import KVPages, PageFree, PageMove
    from splash.switch.columns import Columns
    from splash.switch.manifest_check import kv_pairs as _kv_pairs

    live = [LiveRequest(req_id=7, context=32, owner=0, pages=[[0, 1], [-1, -1]])]
    cols = Columns.of(live, 2, 16)
    new = np.array([[0, 1], [2, 3]])
    fresh = np.array([[0, 0], [1, 1]])

    def pairs(moves: list, frees: list) -> dict:
        return _kv_pairs(KVPages.of(moves, frees), live, cols, new, fresh, 16)

    ok = [PageMove(0, (0, 1), 0, 1, 32, 0.0)]
    assert pairs(ok, [])[(0, 1)].tolist() == [[0, 2, 16], [1, 3, 16]]
    with pytest.raises(RuntimeError, match="request 7, outside its 2 pages"):
        pairs([PageMove(0, (0, 5), 0, 1, 32, 0.0)], [])
    with pytest.raises(RuntimeError, match="request 7, outside its 2 pages"):
        pairs(ok, [PageFree(0, 0, (9,), 16, 0.0)])
    with pytest.raises(RuntimeError, match="1->0, which the page tables do not allow"):
        pairs([PageMove(0, (0, 1), 1, 0, 32, 0.0)], [])
    with pytest.raises(RuntimeError, match=r"moves \(rank, page\) \[\[1, 1\]\] of request 7 differ"):
        pairs([PageMove(0, (0,), 0, 1, 16, 0.0)], [])
    with pytest.raises(RuntimeError, match=r"frees \(rank, page\) \[\[0, 1\]\] of request 7 differ"):
        pairs(ok, [PageFree(0, 0, (1,), 16, 0.0)])
    with pytest.raises(RuntimeError, match="names a request or rank outside"):
        pairs([PageMove(0, (0, 1), 0, 2, 32, 0.0)], [])
