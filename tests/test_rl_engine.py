"""RL in the engine, float64 against transformers: weight updates (disk, tensors, a trainer's broadcast)
in every layout at T=2 and T=4 and across a live switch right after an update; all-or-nothing refusals; pause
(abort / retract / in place); memory release that really returns memory; routed experts.

Two tiny V3 checkpoints A and B of one config; transformers gives each one's greedy tokens and their
logprobs. One rank group per T serves every multi-rank engine of the file (loaded per layout onto it).
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers_ckpt import build_checkpoint
from rl_utils import Trainer, reference
from safetensors.torch import load_file

from splash.distributed.launch import free_port
from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams
from splash.model.update import WeightUpdateError

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

NEW = 5
PROMPTS = [[5, 6, 7], list(range(10, 29)), [90, 1, 33, 4, 8, 61, 17]]
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=16, device="cpu")
LAYOUTS = ("tp", "dp", "cp", "dop")
TOL = 1e-9


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a = build_checkpoint(tmp_path_factory.mktemp("A"), "v3", seed=0)
    b = build_checkpoint(tmp_path_factory.mktemp("B"), "v3", seed=1)
    ra, rb = reference(a, PROMPTS, NEW), reference(b, PROMPTS, NEW)
    assert ra[0] != rb[0], "the two checkpoints must generate differently for the test to mean anything"
    return {"A": (a, ra), "B": (b, rb)}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0, **kw)


def run(eng, prompts=PROMPTS, on_step=None, **kw):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, params=greedy(**kw))
    done, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
        steps += 1
        if on_step is not None:
            on_step(eng, steps)
    return [done[f"r{i}"] for i in range(len(prompts))]


def check(outs, ref, what: str) -> None:
    toks, lps, _ = ref
    assert [o.token_ids for o in outs] == toks, f"{what}: tokens differ from transformers'"
    for o, want in zip(outs, lps):
        got = [d[t] for d, t in zip(o.logprobs, o.token_ids)]
        assert max(abs(x - y) for x, y in zip(got, want)) < TOL, f"{what}: logprobs differ"


def broadcast_update(eng, path: str, name: str) -> None:
    """A trainer thread (rank 0 of its own gloo group) broadcasts every tensor of checkpoint `path`."""
    port, world = free_port(), 1 + eng.world
    tr = Trainer(path, port, world, name).start()
    eng.init_weights_update_group("127.0.0.1", port, 1, world, name, "gloo", timeout_s=60)
    tr.go.set()
    m = tr.meta
    eng.update_weights_from_distributed(m["names"], m["dtypes"], m["shapes"], name, weight_version="dist")
    tr.join()
    eng.destroy_weights_update_group(name)


def all_phases(eng, ckpts, what: str, switch_to: str | None = None) -> None:
    (a, ra), (b, rb) = ckpts["A"], ckpts["B"]
    check(run(eng), ra, f"{what} A")
    eng.update_weights_from_disk(b, weight_version="b1")
    assert eng.weight_version == "b1" and eng.stats()["weight_version"] == "b1"
    check(run(eng), rb, f"{what} disk B")
    eng.update_weights_from_tensors(load_file(f"{a}/model.safetensors"), weight_version="a2")
    check(run(eng), ra, f"{what} tensors A")
    broadcast_update(eng, b, f"g-{what}")
    assert eng.weight_version == "dist"
    if switch_to is None:
        check(run(eng), rb, f"{what} broadcast B")
        return
    # right after the update, a live switch at the second step of the next rollout
    before = eng.switcher.stats()["num_switches"]
    check(run(eng, on_step=lambda e, s: s == 1 and e.switcher.request(switch_to)), rb,
          f"{what} broadcast B, then switch to {switch_to}")
    assert eng.switcher.stats()["num_switches"] == before + 1 and eng.allocator.layout == switch_to
    eng.update_weights_from_tensors(load_file(f"{a}/model.safetensors"))
    check(run(eng), ra, f"{what} tensors A after the switch")


def test_updates_match_transformers_at_one_rank(ckpts):
    eng = build_engine(model=ckpts["A"][0], num_kv_pages=64, **ENGINE)
    try:
        all_phases(eng, ckpts, "T1")
    finally:
        eng.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_updates_match_transformers_in_every_layout(ckpts, group, layout):
    nxt = LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)]
    eng = build_engine(model=ckpts["A"][0], layout=layout, rank_group=group, num_kv_pages=64, **ENGINE)
    try:
        all_phases(eng, ckpts, f"T2 {layout}", switch_to=nxt)
    finally:
        eng.shutdown()


def test_bad_updates_change_nothing(ckpts, group, tmp_path):
    (a, ra), (b, _) = ckpts["A"], ckpts["B"]
    eng = build_engine(model=a, layout="dop", rank_group=group, num_kv_pages=64, **ENGINE)
    try:
        good = load_file(f"{b}/model.safetensors")
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        bad_shape = {**good, name: good[name][:-1]}
        with pytest.raises(WeightUpdateError, match="kv_b_proj.*shape"):
            eng.update_weights_from_tensors(bad_shape)
        with pytest.raises(WeightUpdateError, match="not a weight"):
            eng.update_weights_from_tensors({**good, "model.layers.9.mlp.gate.weight": good[name]})
        nan = {**good, name: good[name].clone().fill_(float("nan"))}
        with pytest.raises(WeightUpdateError, match="NaN"):
            eng.update_weights_from_tensors(nan)
        with pytest.raises(WeightUpdateError, match="not a torch.Tensor"):
            eng.update_weights_from_tensors({name: [1.0]})
        partial = tmp_path / "partial"
        partial.mkdir()
        (partial / "config.json").write_text(open(f"{b}/config.json").read())
        from safetensors.torch import save_file

        save_file({k: v for k, v in good.items() if "layers.2.mlp.experts.3." not in k},
                  str(partial / "model.safetensors"))
        with pytest.raises(WeightUpdateError, match="lacks tensor 'model.layers.2.mlp.experts.3"):
            eng.update_weights_from_disk(str(partial))
        with pytest.raises(WeightUpdateError, match="not a checkpoint"):
            eng.update_weights_from_disk(str(tmp_path / "nowhere"))
        with pytest.raises(WeightUpdateError, match="no weight-update group"):
            eng.update_weights_from_distributed([name], ["float64"], [list(good[name].shape)], "none")
        with pytest.raises(WeightUpdateError, match="rank_offset"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 0, 3, "g")
        # a broadcast with a bad tensor in the middle: every tensor is still received (the trainer
        # finishes), then the whole update is refused
        port, world = free_port(), 1 + eng.world
        tr = Trainer(b, port, world, "bad", change=lambda t: t[name].fill_(float("inf"))).start()
        eng.init_weights_update_group("127.0.0.1", port, 1, world, "bad", "gloo", timeout_s=60)
        tr.go.set()
        m = tr.meta
        with pytest.raises(WeightUpdateError, match="kv_b_proj.*infinite"):
            eng.update_weights_from_distributed(m["names"], m["dtypes"], m["shapes"], "bad")
        tr.join()
        eng.destroy_weights_update_group("bad")
        assert eng.weight_version == "default"
        check(run(eng), ra, "after refused updates")  # the old weights kept serving, on every rank
        # a partial update (one tensor) is fine: names absent keep their values
        eng.update_weights_from_tensors({"model.norm.weight": good["model.norm.weight"]})
        part = build_engine(model=a, num_kv_pages=64, **ENGINE)
        try:
            part.update_weights_from_tensors({"model.norm.weight": good["model.norm.weight"]})
            assert [o.token_ids for o in run(eng)] == [o.token_ids for o in run(part)]
        finally:
            part.shutdown()
    finally:
        eng.shutdown()


def test_pause_modes_and_abort_with_partial_outputs(ckpts, group):
    a, ra = ckpts["A"]
    eng = build_engine(model=a, layout="dp", rank_group=group, num_kv_pages=64, **ENGINE)
    try:
        # in place: running requests keep their KV and resume with identical tokens
        check(run(eng, on_step=_pause_once("in_place")), ra, "in-place pause")
        # retract: pages freed while paused; recomputed after, same tokens
        check(run(eng, on_step=_pause_once("retract")), ra, "retract pause")
        # abort: every request ends now with what it had
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"x{i}", prompt_token_ids=p, params=greedy())
        for _ in range(3):
            eng.step()
        outs = eng.pause_generation("abort")
        assert sorted(o.request_id for o in outs) == ["x0", "x1", "x2"]
        for o in outs:
            c = o.outputs[0]
            assert o.finished and c.finish_reason == "abort"
            assert c.token_ids == ra[0][PROMPTS.index(o.prompt_token_ids)][:len(c.token_ids)]
        assert any(o.outputs[0].token_ids for o in outs)
        assert sum(eng.stats()["kv_pages_used_per_rank"]) == 0 and not eng.has_unfinished()
        eng.continue_generation()
        check(run(eng), ra, "after an abort pause")
        eng.add_request("y", prompt_token_ids=PROMPTS[1], params=greedy())
        eng.step()
        out = eng.abort("y")
        assert out.outputs[0].finish_reason == "abort" and sum(eng.stats()["kv_pages_used_per_rank"]) == 0
        with pytest.raises(ValueError, match="pause mode"):
            eng.pause_generation("later")
    finally:
        eng.shutdown()


def _pause_once(mode: str):
    def hook(eng, step: int) -> None:
        if step != 3:
            return
        eng.pause_generation(mode)
        used = sum(eng.stats()["kv_pages_used_per_rank"])
        assert (used == 0) if mode == "retract" else (used > 0)
        assert eng.step() == [] and eng.step() == []  # nothing runs while paused
        assert eng.stats()["paused"]
        eng.continue_generation()
    return hook


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_release_returns_memory_and_resume_serves_the_same_weights(ckpts):
    from splash.llm import LLM

    pages = 16384  # a 40 MiB KV pool on this config in float64, well above RSS noise
    llm = LLM(ckpts["A"][0], num_kv_pages=pages, **{k: v for k, v in ENGINE.items() if k != "dtype"},
              dtype="float64")
    try:
        eng = llm.llm_engine
        b = ckpts["B"][0]
        llm.update_weights_from_disk(b)  # what wake-up must give back: the last weights, not the start's
        ref = [o.outputs[0].token_ids
               for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())]
        assert ref == ckpts["B"][1][0]
        eng.runner.pool.data.fill_(1.0)  # make every page resident
        pool_mib = eng.runner.pool.nbytes / 2**20
        gc.collect()
        before = _rss_mib()
        llm.sleep(level=1)
        gc.collect()
        after = _rss_mib()
        assert before - after > 0.8 * pool_mib, (before, after, pool_mib)
        assert llm.is_sleeping()
        with pytest.raises(RuntimeError, match="memory is released"):
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())
        eng.add_request("w", prompt_token_ids=PROMPTS[0], params=greedy())  # waits while released
        assert eng.step() == [] and eng.has_unfinished()
        with pytest.raises(WeightUpdateError, match="released"):
            llm.update_weights_from_disk(b)
        llm.wake_up(["weights"])
        assert eng.step() == []  # the KV cache is still released
        llm.wake_up(["kv_cache"])
        assert [o.token_ids for o in run_until(eng, "w")] == [ref[0]]
        assert [o.outputs[0].token_ids for o in
                llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())] == ref
        # level 2 discards the weights and re-reads the checkpoint last loaded (B)
        llm.sleep(level=2)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in
                llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())] == ref
        with pytest.raises(ValueError, match="memory tag"):
            eng.release_memory_occupation(["gpu"])
    finally:
        llm.shutdown()


def run_until(eng, rid: str):
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished and o.request_id == rid:
                return o.outputs
    raise AssertionError(f"{rid} never finished")


def test_routed_experts_match_transformers(ckpts, group):
    a, ra = ckpts["A"]
    eng = build_engine(model=a, layout="cp", rank_group=group, num_kv_pages=64, **ENGINE)
    try:
        # plain, and with a retract mid-way (positions recomputed replace what was recorded)
        for outs in (run(eng, return_routed_experts=True),
                     run(eng, on_step=_pause_once("retract"), return_routed_experts=True)):
            for o, p, want in zip(outs, PROMPTS, ra[2]):
                got = o.routed_experts
                assert got.shape == (len(p) + NEW - 1, want.shape[1], want.shape[2])
                assert torch.equal(got, want)
        assert all(o.routed_experts is None for o in run(eng))  # only when asked
    finally:
        eng.shutdown()


@pytest.mark.parametrize("how", ["file", "host", "reload"])
def test_release_and_restore_weights_bit_for_bit(ckpts, tmp_path, how):
    from splash.engine.weights import local_model
    from splash.model.loader import CheckpointReader
    from splash.model.update import release_weights, restore_weights, weight_buffers

    a = ckpts["A"][0]
    eng = build_engine(model=a, num_kv_pages=16, **ENGINE)
    try:
        model = local_model(eng)
        before = {n: b.clone() for n, b in weight_buffers(model).items()}
        saved = release_weights(model, str(tmp_path) if how == "file" else None, host_copy=how == "host")
        assert all(b.numel() == 0 for b in weight_buffers(model).values())
        restore_weights(model, saved, (lambda: CheckpointReader(a)) if how == "reload" else None)
        after = weight_buffers(model)
        assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
        assert not list(tmp_path.iterdir())  # the backup file is gone
        check(run(eng), ckpts["A"][1], f"restored ({how})")
    finally:
        eng.shutdown()
