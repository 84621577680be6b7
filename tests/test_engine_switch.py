"""Live layout switches through the ENGINE (splash/switch/controller.py) on T = 2 and T = 4 gloo ranks.

A tiny float64 DeepSeek-V3 checkpoint (transformers-made) serves a batch of unequal prompts with
chunked prefill (8 rows per step) while a forced schedule switches the layout at consecutive steps
along a circuit that takes all 12 directions (the first switches land in the middle of chunked
prefills). Checked: greedy tokens equal transformers'; every sampled row's logits equal the
unswitched single-rank engine's to 1e-9; every request comes back exactly once; after every step
the page accounting of every rank balances (each used page in exactly one live table or withheld,
tables follow the running layout's placement rule) and the runner's layout is the allocator's;
overlapped and blocking modes give bit-identical logits; a batch with fewer requests than ranks
(ranks owning nothing) switches too; a switch refused for memory leaves the engine serving in its
layout; `layout="auto"` with a crafted theta switches and changes no token, nor does the regret
guard's switch back (forced by a synthetic step-time source).
"""

from __future__ import annotations

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference

from splash.config import parse_schedule
from splash.core.model_config import ConfigError
from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

NEW = 6
P = 4
PROMPTS = [[5, 6, 7], list(range(10, 31)), list(range(3, 12)), [90, 1, 33, 4, 8, 61], list(range(40, 54)),
           [17, 18, 2, 44, 71, 9, 9, 13, 60, 12, 50]]
ENGINE = dict(dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=8, device="cpu")
# An Eulerian circuit of the complete digraph on the four layouts: all 12 directions, once each.
CIRCUIT = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
ALL12 = "".join(f"{i + 1}:{lay}," for i, lay in enumerate(CIRCUIT[1:])).rstrip(",")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint, transformers' greedy tokens, and the single-rank engine's sampled logits."""
    path = build_checkpoint(tmp_path_factory.mktemp("eswitch") / "v3", "v3", seed=3)
    hf = hf_reference(path)
    ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    del hf
    eng = build_engine(model=path, num_kv_pages=64, **ENGINE)
    try:
        toks, logits, _ = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert toks == ref, "the single-rank engine disagrees with transformers"
    return path, ref, logits


def greedy(new: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)


def accounting_errors(eng) -> list[str]:
    """The engine's books (splash/kv/books.py: every used page of every rank is in exactly one live
    table, a prefix-cache block with as many holders as references, or withheld for replicas; tables
    follow the running layout's placement), and rank 0's runner runs the allocator's layout."""
    errs = eng.scheduler.book_errors()
    local = getattr(eng.runner, "local", None)
    if local is not None and local.layout.name != eng.allocator.layout:
        errs.append(f"runner runs {local.layout.name}, allocator {eng.allocator.layout}")
    return errs


def serve_aborting(eng, prompts, params, abort_step: int = 4, abort_id: int = 1):
    """Serve `prompts` (request ids 0..), aborting request `abort_id` at step `abort_step`:
    ({request id: final CompletionOutput}, per-step accounting errors)."""
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=params)
    done, errors = {}, []
    while eng.has_unfinished():
        if eng.steps == abort_step:
            done[abort_id] = eng.abort(str(abort_id)).outputs[0]
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0]
        errors += [f"step {eng.steps}: {e}" for e in accounting_errors(eng)]
    return done, errors


def run(eng, prompts, new=NEW):
    """Greedy tokens per prompt, {(prompt, position): logits row}, and per-step accounting errors."""
    logits: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[str] = []

    def hook(plan, seqs, rows):
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
            key = (int(seq.group.request_id), len(seq.output_token_ids))
            assert key not in logits, f"row {key} sampled twice"
            logits[key] = row.clone()

    eng.logits_hook = hook
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=greedy(new))
    done: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                rid = int(o.request_id)
                assert rid not in done, f"request {rid} finished twice"
                done[rid] = o.outputs[0].token_ids
        errors += [f"step {eng.steps}: {e}" for e in accounting_errors(eng)]
    eng.logits_hook = None
    assert sorted(done) == list(range(len(prompts))), f"requests lost: {set(range(len(prompts))) - set(done)}"
    assert eng.stats()["kv_pages_used"] == sum(len(w) for w in getattr(eng.switcher, "withheld", [[]]))
    return [done[i] for i in range(len(prompts))], logits, errors


def close(logits, ref_logits, name: str) -> None:
    assert logits.keys() == ref_logits.keys(), f"{name}: sampled rows differ"
    err = max((logits[k] - ref_logits[k]).abs().max().item() for k in logits)
    assert err < 1e-9, f"{name}: logits differ from the unswitched single-rank engine by {err:.2e}"


def test_all_12_directions_through_the_engine(group, ckpt):
    """Both modes, all 12 directions in consecutive steps from step 1 (mid chunked prefill), then a
    batch with fewer requests than ranks (some ranks own nothing) switching through DP/DOP."""
    path, ref, ref_logits = ckpt
    world = group.world
    results = {}
    for mode in ("overlapped", "blocking"):
        eng = build_engine(model=path, layout="tp", rank_group=group, num_kv_pages=96, switch_schedule=ALL12,
                           switch_mode=mode, **ENGINE)
        try:
            toks, logits, errors = run(eng, PROMPTS)
            st = eng.stats()
            events = list(eng.switcher.events)
        finally:
            eng.shutdown()
        name = f"T={world} {mode}"
        assert not errors, f"{name}: {errors[:5]}"
        assert toks == ref, f"{name}: tokens differ from transformers"
        close(logits, ref_logits, name)
        done = {(e.src, e.dst) for e in events if e.refused is None}
        assert done == set(zip(CIRCUIT, CIRCUIT[1:])), f"{name}: switched {sorted(done)}"
        assert st["num_switches"] == 12 and st["switch_refusals"] == 0 and st["layout"] == "tp"
        assert all(e.mode == mode for e in events)
        assert any(e.bytes_per_layer > 0 for e in events)
        results[mode] = logits
    for k in results["overlapped"]:
        assert torch.equal(results["overlapped"][k], results["blocking"][k]), f"modes differ at {k}"

    few = [2, 0][: world // 2]  # 1 request at T=2, 2 at T=4: ranks that own nothing
    eng = build_engine(model=path, layout="cp", rank_group=group, num_kv_pages=96,
                       switch_schedule="1:dp,2:tp,3:dop,4:cp,5:dop,6:dp", **ENGINE)
    try:
        toks, logits, errors = run(eng, [PROMPTS[i] for i in few])
        assert eng.stats()["num_switches"] == 6
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert toks == [ref[i] for i in few]
    close(logits, {(n, pos): ref_logits[(i, pos)] for n, i in enumerate(few) for pos in range(NEW)}, "few")


def fixed_bytes(path, group) -> int:
    """A rank's weights and step workspace (DOP, sharded projections): a budget beyond this is KV."""
    probe = build_engine(model=path, layout="dop", rank_group=group, num_kv_pages=4, **ENGINE)
    st = probe.stats()
    probe.shutdown()
    return max(st["weight_bytes_per_rank"]) + st["kv_reserve_bytes"]


def test_leaving_dp_counts_the_replica_pages_it_returns(group, ckpt):
    """DP withholds its replicas' pages and a switch out of DP gives them back, so DP -> TP's Eq 6 has
    them: a batch whose final KV fits TP's pool only with those pages switches (the engine's own
    pre-check and the planner agree; the planner used to refuse it). A budget too small for DP's
    replicas is a clear error, not a crash."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, ref, _ = ckpt
    base = fixed_bytes(path, group)
    with pytest.raises(ConfigError, match="replicated attention projections take"):
        build_engine(model=path, layout="dp", rank_group=group, memory_per_rank=base + 32 * 1024,
                     switch_schedule="3:tp", **ENGINE)
    eng = build_engine(model=path, layout="dp", rank_group=group, memory_per_rank=base + 200 * 1024,
                       switch_schedule="3:tp", **ENGINE)
    try:
        dp_pages, w = eng.allocator.num_total[0], eng.switcher.weight_pages[0]
        want = dp_pages + (w + 1) // 2  # more than DP's pool, less than TP's (the replicas' pages back)
        prompts = PROMPTS[:4]
        finals = [want // 4 + (i < want % 4) for i in range(4)]  # pages per request at its limit
        assert w > 1 and sum(finals) == want and all(f * P > len(p) + NEW for f, p in zip(finals, prompts))
        for i, (p, f) in enumerate(zip(prompts, finals)):
            limit = SamplingParams(temperature=0.0, max_tokens=f * P - len(p), ignore_eos=True)
            eng.add_request(str(i), prompt_token_ids=p, params=limit)
        done, errors, fits = {}, [], None
        while eng.has_unfinished():
            if eng.steps == 2:
                fits = eng.switcher.fits("tp", [s for s in eng.scheduler.running if s.pages])
            for o in eng.step():
                if o.finished:
                    done[int(o.request_id)] = o.outputs[0].token_ids
            errors += [f"step {eng.steps}: {e}" for e in accounting_errors(eng)]
        st = eng.stats()
    finally:
        eng.shutdown()
    assert fits is True
    assert st["switch_refusals"] == 0 and st["num_switches"] == 1 and st["layout"] == "tp", st
    assert not errors, errors[:5]
    assert sorted(done) == [0, 1, 2, 3] and [done[i][:NEW] for i in range(4)] == ref[:4]


def test_refused_switch_keeps_serving(group, ckpt):
    """DP -> TP needs every history on every rank: in a tight pool it is refused (Eq 5), logged, and
    the engine finishes the batch in DP with the same answer."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, ref, ref_logits = ckpt
    eng = build_engine(model=path, layout="dp", rank_group=group, num_kv_pages=14, switch_schedule="6:tp",
                       **ENGINE)
    try:
        toks, logits, errors = run(eng, PROMPTS)
        st = eng.stats()
        refused = [e for e in eng.switcher.events if e.refused]
    finally:
        eng.shutdown()
    assert st["switch_refusals"] == 1 and st["num_switches"] == 0 and st["layout"] == "dp", st
    assert refused[0].refused in ("eq5", "eq6") and "rank" in refused[0].message
    assert not errors, errors[:5]
    assert toks == ref
    close(logits, ref_logits, "refused")


def test_switch_never_strands_a_queued_request(group, ckpt):
    """A request queued in CP (its context fits CP's position shards, not one TP pool) keeps a forced
    CP -> TP switch from happening (refused, "request"): it used to come back empty, "length"."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    path = ckpt[0]
    short, long = [5, 6, 7], list(range(5, 55))  # CP holds 2 x 10 pages x 4 = 80 tokens, TP 40
    kw = {**ENGINE, "max_num_seqs": 1}
    one = build_engine(model=path, num_kv_pages=64, **kw)
    try:
        want, _, _ = run(one, [short, long])
    finally:
        one.shutdown()
    eng = build_engine(model=path, layout="cp", rank_group=group, num_kv_pages=10, switch_schedule="3:tp",
                       **kw)
    try:
        assert eng.max_request_tokens == 80
        got, _, errors = run(eng, [short, long])  # max_num_seqs=1: `long` waits while `short` runs
        st = eng.stats()
        refused = [e for e in eng.switcher.events if e.refused]
    finally:
        eng.shutdown()
    assert [len(t) for t in got] == [NEW, NEW] and got == want
    assert st["layout"] == "cp" and st["num_switches"] == 0 and st["switch_refusals"] == 1, st
    assert refused[0].refused == "request"
    msg = refused[0].message
    assert "waiting request '1' reaches 56 tokens" in msg and "at most 40 in tp" in msg, msg
    assert not errors, errors[:5]


def test_auto_layout_switches_without_changing_tokens(group, ckpt, tmp_path):
    """`layout="auto"` starts in DOP; a theta whose collectives cost 10 ms each makes DP/TP (one
    collective per layer) lead DOP (three) by far, so the policy switches; tokens are unchanged."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    from splash.calibration import runtime_prior
    from splash.core.model_config import ModelConfig
    from splash.core.sizes import AttentionSizes

    path, ref, ref_logits = ckpt
    cfg = ModelConfig.from_hf(path)
    theta = runtime_prior(2, AttentionSizes(cfg, "fp64", "fp64")).to_dict()
    theta["latency"] = 0.01
    f = tmp_path / "theta.json"
    import json

    f.write_text(json.dumps(theta))
    eng = build_engine(model=path, rank_group=group, num_kv_pages=96, theta=str(f), switch_margin=0.05,
                       min_dwell_steps=2, **ENGINE)
    try:
        assert eng.stats()["layout_mode"] == "auto" and eng.allocator.layout == "dop"
        toks, logits, errors = run(eng, PROMPTS)
        st = eng.stats()
        decisions = list(eng.switcher.decisions)
    finally:
        eng.shutdown()
    assert st["num_switches"] >= 1 and st["layout"] in ("dp", "tp"), st
    assert decisions and all(set(d.times_s) == {"tp", "dp", "cp", "dop"} for d in decisions)
    assert any(d.switch for d in decisions) and all(d.reason for d in decisions)
    assert not errors, errors[:5]
    assert toks == ref
    close(logits, ref_logits, "auto")


def _guarded_auto(group, ckpt, tmp_path, new: int, timer):
    """The unswitched single-rank reference (tokens, logits) for `new` tokens per request, and an auto
    engine on the crafted theta (DOP's three collectives per layer at 10 ms latency: DP and TP predicted
    far faster, so auto leaves DOP once its 14-step dwell ends), its guard judging on 2 steps and its
    step clock replaced by `timer` (layout, key, predicted) -> seconds."""
    import json

    from splash.calibration import runtime_prior
    from splash.core.correction import CorrectionConfig
    from splash.core.model_config import ModelConfig
    from splash.core.sizes import AttentionSizes

    path, _, _ = ckpt
    one = build_engine(model=path, num_kv_pages=96, **ENGINE)
    try:
        ref, ref_logits, _ = run(one, PROMPTS, new)
    finally:
        one.shutdown()
    theta = runtime_prior(2, AttentionSizes(ModelConfig.from_hf(path), "fp64", "fp64")).to_dict()
    theta["latency"] = 0.01
    f = tmp_path / "theta.json"
    f.write_text(json.dumps(theta))
    eng = build_engine(model=path, rank_group=group, num_kv_pages=96, theta=str(f), min_dwell_steps=14,
                       **ENGINE)
    fb = eng.switcher.feedback
    fb.correction.config = CorrectionConfig(min_samples=1)  # a short batch: judge on few steps
    fb.guard.window, fb.guard.settle = 2, 0
    fb.timer = timer
    return ref, ref_logits, eng


def test_auto_switch_back_by_the_regret_guard_changes_no_token(group, ckpt, tmp_path):
    """The same crafted theta makes auto leave DOP once its dwell ends (in the decode phase); a synthetic
    step-time source (no wall clock) then says every other layout runs 5x slower than DOP on this
    machine: the regret guard switches back, counts it, blocks the layout it left, and every token and
    logit equals the unswitched single-rank engine's (16 tokens per request: a longer decode phase)."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    new = 16
    ref, ref_logits, eng = _guarded_auto(group, ckpt, tmp_path, new,
                                         lambda layout, key, predicted: 0.001 if layout == "dop" else 0.005)
    try:
        toks, logits, errors = run(eng, PROMPTS, new)
        st = eng.stats()
        events = [e for e in eng.switcher.events if e.refused is None]
        decisions = list(eng.switcher.decisions)
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert toks == ref
    close(logits, ref_logits, "auto with a switch back")
    backs = [e for e in events if e.cause == "guard"]
    assert st["num_switch_backs"] == len(backs) >= 1 and sum(st["switch_backs_total"].values()) == len(backs)
    first = events.index(backs[0])
    assert events[first - 1].cause == "auto" and backs[0].dst == "dop" == events[first - 1].src
    assert not any(e.dst == backs[0].src for e in events[first + 1:]), "the layout it left is blocked"
    assert any(d.reason.startswith("switch back") for d in decisions)
    assert st["theta_correction"]["dop"]["steps"] > 0 and st["regret_verdicts"][0]["switch_back"]
    rec = next(d for d in decisions if d.switch)
    assert set(rec.corrected_s) == set(rec.observed_s) == {"tp", "dp", "cp", "dop"} and rec.kind


def test_auto_recheck_lifts_a_block_when_the_machine_slowed_and_changes_no_token(group, ckpt, tmp_path):
    """The same crafted theta; a synthetic step-time source in which the machine slows 3x at the very
    step auto leaves DOP: the destination (2 ms) looks slower than DOP's pace from before (1 ms), so the
    guard switches back; DOP, back again, takes 3 ms, slower than the destination did, so the recheck
    lifts the block. Tokens and logits equal the unswitched single-rank engine's (24 tokens per request:
    room for the probation and the recheck after the dwell)."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    new = 24
    slow: list[str] = []

    def timer(layout: str, key, predicted: float) -> float:
        if layout != "dop" and not slow:
            slow.append(layout)
        return (0.003 if slow else 0.001) if layout == "dop" else 0.002

    ref, ref_logits, eng = _guarded_auto(group, ckpt, tmp_path, new, timer)
    try:
        toks, logits, errors = run(eng, PROMPTS, new)
        st = eng.stats()
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert toks == ref
    close(logits, ref_logits, "auto with a switch back and a recheck")
    verdicts = st["regret_verdicts"]
    assert st["num_switch_backs"] >= 1 and verdicts[0]["switch_back"], verdicts
    lifted = [v for v in verdicts if v["unblocked"]]
    assert lifted and lifted[0]["dst"] == slow[0] and lifted[0]["regret"] == pytest.approx(1.5), verdicts


def test_schedule_parsing_and_bad_input():
    assert parse_schedule("8:dp, 2:CP") == [(2, "cp"), (8, "dp")]
    for bad, msg in (("8-dp", "STEP:LAYOUT"), ("x:dp", "STEP:LAYOUT"), ("3:pp", "unknown layout"),
                     ("3:dp,3:tp", "twice")):
        with pytest.raises(ConfigError, match=msg):
            parse_schedule(bad)
    with pytest.raises(ConfigError, match="needs T > 1"):
        build_engine(model="tiny", switch_schedule="2:dp", num_kv_pages=8, device="cpu")


def test_budget_withholds_replica_pages(group, ckpt):
    """Under --memory-per-rank with switching, the pool is sized for sharded projections and DP/CP
    withhold the pages their replicas take: capacities follow the layout, accounting still balances."""
    if group.world != 2:
        pytest.skip("once, at T = 2")
    path, ref, ref_logits = ckpt
    memory = fixed_bytes(path, group) + 200 * 1024
    eng = build_engine(model=path, layout="dop", rank_group=group, memory_per_rank=memory,
                       switch_schedule="2:dp,4:tp,6:cp,8:dop", **ENGINE)
    seen = {}
    eng.on_step.append(lambda info: seen.setdefault(eng.allocator.layout,
                                                    (eng.stats()["weight_pages_withheld"],
                                                     eng.allocator.num_total)))
    try:
        toks, logits, errors = run(eng, PROMPTS)
        wp = eng.switcher.weight_pages
    finally:
        eng.shutdown()
    assert not errors, errors[:5]
    assert toks == ref
    close(logits, ref_logits, "budget")
    assert wp[0] > 0 and set(seen) == {"dop", "dp", "tp", "cp"}
    for lay, (held, total) in seen.items():
        want = wp if lay in ("dp", "cp") else [0, 0]
        assert held == want, f"{lay}: withheld {held}, expected {want}"
        assert total == [t - w for t, w in zip(seen["dop"][1], want)]
