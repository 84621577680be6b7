"""The engine on T ranks (rank 0 here, workers spawned) in each layout, float64, tiny MoE checkpoints.

One rank group per T (2, then 4) is started once and every engine of this file is *loaded* onto it
(V3 with q_lora_rank and V2 without, x 4 layouts), so the whole file spawns few processes. Checked:
greedy tokens equal transformers' and every sampled row's logits equal the single-rank engine's to
1e-9 (a batch of unequal prompts with chunked prefill, and a batch smaller than T); measured bytes per
collective and layer equal the analytical counts (DOP's exchange = Eq 4 for the step's rows); the
per-layout pools on one --memory-per-rank (DOP - DP = W_A(1-1/T)/k per rank, TP = DOP per rank but
1/T of its distinct tokens); a batch admitted whole under DOP is partly queued under DP; two node
processes on loopback give the single-process tokens; a hung (T=2) or killed (T=4) worker fails the
engine within a bounded time. Every multi-rank step is bounded by the group's collective timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers_ckpt import build_checkpoint, hf_greedy, hf_reference

from splash.core.costmodel import eq4_bytes
from splash.core.model_config import ConfigError, ModelConfig
from splash.core.sizes import AttentionSizes
from splash.distributed.launch import WorkerError, free_port
from splash.engine.build import build_engine
from splash.engine.group import GroupFailed, RankGroup
from splash.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

LAYOUTS = ("tp", "dp", "cp", "dop")
NEW = 6
P = 4
PROMPTS = [[5, 6, 7], list(range(10, 31)), list(range(3, 12)), [90, 1, 33, 4, 8, 61], list(range(40, 54)),
           [17, 18, 2, 44, 71, 9, 9, 13, 60, 12, 50]]
ENGINE = dict(dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=16, device="cpu")
TIMEOUT_S = 12.0  # collective timeout of the groups: bounds every step, and the hang test


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """V3 (q_lora, noaux_tc) and V2 (no q_lora, greedy routing), transformers' greedy tokens, and the
    single-rank engine's logits of every sampled row."""
    out = {}
    for kind, seed in (("v3", 0), ("v2", 1)):
        path = build_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=seed)
        hf = hf_reference(path)
        ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
        del hf
        eng = build_engine(model=path, num_kv_pages=64, **ENGINE)
        toks, logits = run(eng, PROMPTS)
        assert toks == ref, f"{kind}: the single-rank engine disagrees with transformers"
        out[kind] = (path, ref, logits)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["T2", "T4"])
def group(request):
    g = RankGroup.start(request.param, device="cpu", timeout_s=TIMEOUT_S, threads=1)
    yield g
    g.close()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def run(eng, prompts, on_step=None):
    """Greedy tokens per prompt, and {(prompt, output position): logits row} of every sampled row."""
    logits: dict[tuple[int, int], torch.Tensor] = {}

    def hook(plan, seqs, rows):
        for seq, row in zip([s for s, sl in zip(seqs, plan.seqs) if sl.sample], rows):
            logits[(int(seq.group.request_id), len(seq.output_token_ids))] = row.clone()

    eng.logits_hook = hook
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=greedy())
    done = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
        steps += 1
        if on_step:
            on_step(steps)
    eng.logits_hook = None
    return [done[i] for i in range(len(prompts))], logits


def expected_layer_bytes(layout: str, n: int, cfg: ModelConfig, world: int, b: int = 8) -> dict[str, float]:
    """Group totals per layer of the layout's own collectives (counting convention of dist/stats.py)."""
    d, H, d_c, d_r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    reduce = world * (2 * (world - 1) * n * d * b // world)
    if layout == "tp":
        return {"all_reduce": reduce, "all_gather": 0, "all_to_all": 0}
    if layout == "dp":
        return {"all_reduce": 0, "all_gather": n * d * b * (world - 1), "all_to_all": 0}
    if layout == "cp":
        return {"all_reduce": 0, "all_to_all": (world - 1) * n * H * (d_c + 1) * b,
                "all_gather": (world - 1) * n * H * d_c * b}
    return {"all_reduce": reduce, "all_gather": 0, "all_to_all": eq4_bytes(n, H, d_c, d_r, world, b)}


def check_bytes(eng, layout: str, cfg: ModelConfig, world: int) -> int:
    """Every recorded step's bytes per layer and collective, summed over ranks, equal the formulas."""
    cs = eng.comm_stats()
    ranks, rows = cs["ranks"], cs["rows"]
    assert [r["rank"] for r in ranks] == list(range(world))
    checked = 0
    for step, n in rows.items():
        if any(step not in r["steps"] for r in ranks):
            continue
        for layer in range(cfg.num_hidden_layers):
            got = {op: sum(r["steps"][step].get((op, layer), 0) for r in ranks)
                   for op in ("all_reduce", "all_gather", "all_to_all")}
            want = expected_layer_bytes(layout, n, cfg, world)
            assert got == pytest.approx(want, abs=1e-6), f"{layout} step {step} layer {layer} ({n} rows)"
            mlp = sum(r["steps"][step].get(("all_reduce", f"mlp.{layer}"), 0) for r in ranks)
            assert mlp == world * (2 * (world - 1) * n * cfg.hidden_size * 8 // world)
        checked += 1
    assert checked >= 5, f"{layout}: only {checked} steps had stats on every rank"
    return checked


def test_layouts_match_transformers_and_single_rank(group, ckpts):
    """Each layout x checkpoint on T ranks: tokens == transformers, logits == one rank (1e-9), bytes ==
    the analytical counts; then a batch of fewer requests than ranks (some ranks own nothing)."""
    world = group.world
    for kind, (path, ref, ref_logits) in ckpts.items():
        cfg = ModelConfig.from_hf(path)
        for layout in LAYOUTS:
            # The absorbed form throughout: the byte counts below are its (the paper's) formulas; the
            # MHA form of prefill chunks is checked in tests/test_attention_forms.py.
            eng = build_engine(model=path, layout=layout, rank_group=group, num_kv_pages=64,
                               attention_form="absorbed", **ENGINE)
            try:
                st = eng.stats()
                assert (st["layout"], st["ranks"]) == (layout, world)
                toks, logits = run(eng, PROMPTS)
                assert toks == ref, f"{kind}/{layout} T={world}: tokens differ from transformers"
                assert logits.keys() == ref_logits.keys()
                err = max((logits[k] - ref_logits[k]).abs().max().item() for k in logits)
                assert err < 1e-9, f"{kind}/{layout} T={world}: logits differ from one rank by {err:.2e}"
                check_bytes(eng, layout, cfg, world)
                few = [2, 0][: world // 2]  # 1 request at T=2, 2 at T=4
                toks, logits = run(eng, [PROMPTS[i] for i in few])
                assert toks == [ref[i] for i in few], f"{kind}/{layout} T={world}: fewer requests than ranks"
                assert eng.stats()["kv_pages_used"] == 0
            finally:
                eng.shutdown()


def test_pools_per_layout_and_admission(group, ckpts):
    """One --memory-per-rank: DOP - DP = W_A(1-1/T)/k tokens per rank (to a page); TP per rank == DOP
    per rank, distinct TP == DOP / T; a batch that fits DOP is admitted whole, DP queues part of it."""
    world = group.world
    path = ckpts["v3"][0]
    cfg = ModelConfig.from_hf(path)
    kw = dict(ENGINE, max_num_seqs=16, max_num_batched_tokens=256)
    probe = build_engine(model=path, layout="dp", rank_group=group, num_kv_pages=4, **kw)
    st = probe.stats()
    probe.shutdown()
    sizes = AttentionSizes(cfg, "fp64", "fp64")
    dp_tokens = 40
    memory = max(st["weight_bytes_per_rank"]) + st["kv_reserve_bytes"] + int(dp_tokens * sizes.k)
    pools, prompt_len = {}, 12
    ppr = -(-prompt_len // P)  # pages per request at admission
    for layout in LAYOUTS:
        eng = build_engine(model=path, layout=layout, rank_group=group, memory_per_rank=memory, **kw)
        try:
            pools[layout] = eng.stats()
            if layout in ("dp", "dop"):
                dp_pages = pools["dp"]["kv_pool_tokens_per_rank"][0] // P
                n = world * (dp_pages // ppr) + world  # DP's ranks hold all but `world` of these
                prompts = [[3 + (i + j) % 90 for j in range(prompt_len)] for i in range(n)]
                first: list[int] = []

                def record(step: int, e=eng, out=first) -> None:
                    if step == 1:
                        out.append(e.stats()["num_running"])

                run(eng, prompts, on_step=record)
                pools[layout]["first_running"], pools[layout]["n"] = first[0], n
        finally:
            eng.shutdown()
    gain = sizes.w_a * (1 - 1 / world) / sizes.k
    for r in range(world):
        dop, dp = pools["dop"]["kv_pool_tokens_per_rank"][r], pools["dp"]["kv_pool_tokens_per_rank"][r]
        assert abs((dop - dp) - gain) <= P, f"rank {r}: DOP - DP = {dop - dp}, W_A(1-1/T)/k = {gain:.1f}"
        assert pools["tp"]["kv_pool_tokens_per_rank"][r] == dop
        assert pools["cp"]["kv_pool_tokens_per_rank"][r] == dp
    assert abs(min(pools["dp"]["kv_pool_tokens_per_rank"]) - dp_tokens) <= P
    assert pools["tp"]["kv_distinct_tokens"] * world == pools["dop"]["kv_distinct_tokens"]
    assert pools["dop"]["kv_distinct_tokens"] == sum(pools["dop"]["kv_pool_tokens_per_rank"])
    n = pools["dop"]["n"]
    assert pools["dop"]["first_running"] == n, "DOP should admit the whole batch at once"
    assert pools["dp"]["first_running"] == n - world, "DP should queue what its owners cannot hold"


def test_two_nodes_on_loopback_match_one_process(group, ckpts):
    """`splash generate --nnodes 2 --node-rank 0|1 --dist-init-addr` (two processes) == --tp 2 here."""
    if group.world != 2:
        pytest.skip("run once, at T = 2")
    path, ref, _ = ckpts["v3"]
    prompts = PROMPTS[:3]
    eng = build_engine(model=path, layout="dop", rank_group=group, num_kv_pages=64, **ENGINE)
    try:
        here, _ = run(eng, prompts)
    finally:
        eng.shutdown()
    addr = f"127.0.0.1:{free_port()}"
    common = [sys.executable, "-m", "splash", "generate", "--model", path, "--dtype", "float64", "--device",
              "cpu", "--layout", "dop", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr,
              "--page-size", str(P), "--max-tokens", str(NEW), "--ignore-eos", "--json",
              "--collective-timeout", "60"]
    ids = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([*common, "--node-rank", str(r), *ids], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        outs = [n.communicate(timeout=150) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    doc = json.loads(outs[0][0])
    assert doc["engine"]["ranks"] == 2 and doc["engine"]["nnodes"] == 2
    got = [o["token_ids"] for o in doc["outputs"]]
    assert got == here == ref[:3]
    assert outs[1][0] == ""  # node 1 served its rank only


def test_head_count_not_divisible_is_refused(ckpts):
    with pytest.raises(ConfigError, match="4 attention heads cannot be split evenly over 3 ranks"):
        build_engine(model=ckpts["v3"][0], tp=3, layout="dop", **ENGINE)


def test_hung_or_killed_worker_fails_the_engine(group, ckpts):
    """Last on each group (it breaks it). T=2: a worker is stopped (hang -> rank 0's next send times
    out); T=4: one is killed while the server's AsyncEngine streams requests (dead peer), and every
    in-flight stream ends with EngineError. Both within a bounded time; later use fails at once."""
    import asyncio

    from splash.engine.async_engine import AsyncEngine, EngineDeadError, EngineError

    path = ckpts["v3"][0]
    eng = build_engine(model=path, layout="dop", rank_group=group, num_kv_pages=64, **ENGINE)
    pid = group.workers.procs[1].pid
    if group.world == 2:
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), prompt_token_ids=p, params=greedy())
        eng.step()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises((GroupFailed, WorkerError)):
                while eng.has_unfinished():
                    eng.step()
            took = time.monotonic() - t0
            t1 = time.monotonic()
            with pytest.raises(GroupFailed, match="failed earlier"):
                eng.add_request("again", prompt_token_ids=[1, 2, 3], params=greedy())
                eng.step()
            assert time.monotonic() - t1 < 2
        finally:
            with contextlib.suppress(ProcessLookupError):  # normally killed by the engine already
                os.kill(pid, signal.SIGCONT)
            eng.shutdown()
    else:
        aeng = AsyncEngine(eng)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

        async def client(i: int, p: list[int], started: asyncio.Event) -> BaseException | None:
            try:
                async for _ in aeng.generate(p, long, f"c{i}"):
                    started.set()
            except EngineError as e:
                return e
            return None

        async def main() -> tuple[list, float]:
            started = asyncio.Event()
            tasks = [asyncio.create_task(client(i, p, started)) for i, p in enumerate(PROMPTS)]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            res = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S + 15)
            return res, time.monotonic() - t0

        async def again() -> None:
            async for _ in aeng.generate([1, 2, 3], greedy(), "after"):
                pass

        try:
            errors, took = asyncio.run(main())
            assert all(isinstance(e, EngineError) for e in errors), errors
            assert "rank" in str(errors[0])
            t1 = time.monotonic()
            with pytest.raises(EngineDeadError, match="cannot recover from .*restart the server"):
                asyncio.run(again())
            assert time.monotonic() - t1 < 2
            assert not aeng.is_healthy and aeng.dead is not None  # /health answers 503 from here
        finally:
            aeng.shutdown()
    assert took < TIMEOUT_S + 15, f"the engine took {took:.0f} s to notice"
    assert not group.workers.alive()


def test_script_without_main_guard_fails_fast(tmp_path):
    """`LLM(tp=2)` at import time: the spawned rank re-imports the script and dies before joining; rank
    0 says why within seconds instead of waiting out the 300 s start-up timeout."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text("from splash import LLM\nLLM('tiny', tp=2, layout='tp', device='cpu')\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "before joining the group" in r.stderr and '__name__ == "__main__"' in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60
