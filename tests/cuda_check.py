"""One-GPU check of splash's CUDA path (from the repo root: PYTHONPATH=.:tests python3 tests/cuda_check.py).

1. T=1 float64: CUDA engine vs CPU engine vs transformers (tokens equal; logits error printed).
2. T=1 default dtype on CUDA (bf16): runs; seeded sampling on a CUDA generator is reproducible.
3. T=2 live switches with BOTH ranks on cuda:0 over gloo (gloo's CUDA collectives give work.wait() the
   same stream semantics as NCCL), through tests/test_switch.py's driver, with torch.cuda._sleep
   injected on the compute stream after every step and on the side stream before every layer's
   transfer, so a missing stream edge shows up as wrong logits. Compared with the unswitched T=1 run
   on the same device.
4. DSA (DeepSeek-V3.2 and GLM-5 shapes, top-k below the prompts): the float64 engine on CUDA (the sparse
   path through Triton over single-token page tables) against the CPU engine: tokens equal, logits.
DEV=cpu runs parts 1, 3 and 4 on CPU (plumbing check only). CASES=small runs 2 switch cases.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

sys.path[:0] = [".", "tests"]
DEV = os.environ.get("DEV", "cuda")
SLEEP = int(float(os.environ.get("SLEEP_CYCLES", "2e7")))  # ~10 ms at 2 GHz
DT = torch.float64
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def drain(eng, reqs):
    """reqs: [(prompt ids, SamplingParams)] -> token lists in order."""
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(str(i), prompt_token_ids=p, params=sp)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = list(o.outputs[0].token_ids)
    return [done[i] for i in range(len(reqs))]


def part1_2(path) -> None:
    from test_engine_dist import ENGINE, NEW, PROMPTS, run

    from splash.engine.build import build_engine
    from splash.engine.sampling import SamplingParams

    try:
        from helpers_ckpt import hf_greedy, hf_reference

        hf = hf_reference(path)
        ref = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    except Exception as e:  # noqa: BLE001
        log("transformers reference unavailable:", repr(e)[:200])
        ref = None
    cpu_toks, cpu_logits = run(build_engine(model=path, num_kv_pages=64, **ENGINE), PROMPTS)
    log("CPU engine tokens == transformers:", ref is None or cpu_toks == ref)
    eng = build_engine(model=path, num_kv_pages=64, **dict(ENGINE, device=DEV))
    log("engine device:", eng.stats()["device"], "dtype:", eng.stats()["dtype"])
    toks, logits = run(eng, PROMPTS)
    err = max((logits[k].cpu() - cpu_logits[k]).abs().max().item() for k in cpu_logits)
    log(f"PART1 T=1 {DEV} float64: tokens == CPU engine: {toks == cpu_toks}; max |logit - CPU| = {err:.2e}"
        f" (tests/test_engine_cuda.py asks < 1e-5 across devices)")
    eng.shutdown()
    if DEV != "cuda":
        return
    eng = build_engine(model=path, num_kv_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                       device="cuda")  # default dtype on CUDA: bfloat16
    g = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    bt = drain(eng, [(p, g) for p in PROMPTS])
    same = sum(a == b for a, b in zip(bt, cpu_toks))
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True,
                        logprobs=2)
    s1 = drain(eng, [(PROMPTS[1], sp), (PROMPTS[2], g)])
    s2 = drain(eng, [(PROMPTS[1], sp), (PROMPTS[3], g)])
    log(f"PART2 bf16 dtype={eng.stats()['dtype']}: greedy equal to float64 for {same}/{len(PROMPTS)} "
        f"prompts; seeded sample reproducible across batches: {s1[0] == s2[0]}")
    # CPU-GPU syncs of one decode step, by Python source line (torch's sync debug mode)
    import collections
    import warnings

    for i, p in enumerate(PROMPTS):
        eng.add_request(f"s{i}", prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True))
    for _ in range(4):  # past the prefills
        eng.step()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in ws
                                if "synchroniz" in str(w.message))
    log(f"PART2 syncs in one decode step: {sum(where.values())}: {dict(where.most_common(12))}")
    eng.abort_all()
    eng.shutdown()


# ---- part 3: switches on two ranks sharing one device ------------------------------------------------
def rank_cases(grid, path, cases, dev_kind):
    import test_switch as ts

    from splash.distributed.comm import Communicator
    from splash.kv.pool import KVPool
    from splash.model.deepseek import DeepseekForCausalLM
    from splash.switch import executor as exm

    dev = torch.device("cuda", 0) if dev_kind == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    comm = Communicator(grid.group, grid.rank, grid.world, dev, control_group=grid.control)
    swc = Communicator(grid.switch.group, grid.rank, grid.world, dev, control_group=grid.control,
                       stats=comm.stats)
    patch(ts, exm, dev)
    torch.manual_seed(0)
    model = DeepseekForCausalLM.from_pretrained(path, DT, grid.rank, grid.world, attn_sharded=False,
                                                device=dev)
    blocks = ts.full_blocks(model)
    cfg = model.cfg
    pool = KVPool(cfg.num_hidden_layers, ts.NUM_PAGES, ts.P, cfg.latent_dim, DT, dev)
    junk = (torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(100 + grid.rank), dtype=DT)
            * 50).to(dev)
    out = {}
    for src, dst, mode, scen in cases:
        ts.set_layout_heads(model, blocks, src, grid.rank, grid.world)
        pool.data.copy_(junk)
        r = ts.drive(model, pool, comm, swc, grid.rank, grid.world, src, src, scen, dst, mode, ts.NUM_PAGES)
        r["logits"] = [x.cpu() for x in r["logits"]]
        r["inflight"] = [s["result"].max_in_flight for s in r["switches"]]
        r.pop("switches")
        out[(src, dst, mode, scen)] = r
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out


def patch(ts, exm, dev) -> None:
    from splash.worker.context import build_context

    def fwd(model, pool, comm, rank, world, plan, layout):
        ctx = build_context(plan.seqs, kv=pool, layout=layout, comm=comm, rank=rank, world=world,
                                   page_size=ts.P)
        hidden = model(torch.tensor(plan.input_ids, device=dev), ctx.positions, ctx)
        logits = model.compute_logits(hidden[plan.sample_rows()])
        if dev.type == "cuda":
            torch.cuda._sleep(SLEEP)  # this step's KV writes finish late: the next side-stream read must wait
        return logits

    ts.forward = fwd
    launch = exm.SwitchExecutor._launch

    def slow_launch(self, i):
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(SLEEP)  # transfers land late: the compute stream must wait for them
        return launch(self, i)

    exm.SwitchExecutor._launch = slow_launch


def part3(path) -> None:
    import test_switch as ts

    from splash.distributed.comm import LocalCommunicator
    from splash.distributed.launch import spawn_workers
    from splash.kv.pool import KVPool
    from splash.model.deepseek import DeepseekForCausalLM
    from splash.switch import executor as exm

    dev = torch.device("cuda", 0) if DEV == "cuda" else torch.device("cpu")
    patch(ts, exm, dev)
    dirs = [("tp", "dp"), ("dp", "tp"), ("cp", "dop"), ("dop", "cp"), ("tp", "cp"), ("cp", "tp")]
    cases = [(a, b, m, "mixed") for a, b in dirs for m in ("overlapped", "blocking")]
    cases += [("dop", ("cp", "tp", "dp"), "overlapped", "mixed"), ("tp", "dop", "overlapped", "few")]
    if os.environ.get("CASES") == "small":
        cases = [("tp", "dp", "overlapped", "mixed"), ("dop", "cp", "blocking", "mixed")]
    model = DeepseekForCausalLM.from_pretrained(path, DT, 0, 1, device=dev)
    refs = {}
    for scen in sorted({c[3] for c in cases}):
        cfg = model.cfg
        pool = KVPool(cfg.num_hidden_layers, ts.NUM_PAGES, ts.P, cfg.latent_dim, DT, dev)
        c = LocalCommunicator(dev)
        refs[scen] = ts.drive(model, pool, c, c, 0, 1, "tp", "local", scen)
        refs[scen]["logits"] = [x.cpu() for x in refs[scen]["logits"]]
    log(f"PART3 T=1 references done; spawning 2 gloo ranks on {dev} for {len(cases)} cases")
    from splash.config import env_defaults

    comm = env_defaults().get("cpu_comm", "shm")  # (SPLASH_COMM, as an engine's config reads it)
    per = spawn_workers(2, rank_cases, (path, cases, dev.type), timeout_s=400, backend="gloo", threads=2,
                        cpu_comm=comm)
    bad = 0
    for case in cases:
        ref = refs[case[3]]
        lead = per[0][case]
        err = max(((g - w).abs().max().item() if g.numel() else 0.0)
                  for r in per for g, w in zip(r[case]["logits"], ref["logits"], strict=True))
        ok = (not lead["errors"] and lead["tokens"] == ref["tokens"] and err < 1e-9
              and (case[2] != "overlapped" or all(x == 1 for x in lead["inflight"])))
        bad += not ok
        log(f"  {'ok ' if ok else 'BAD'} {case}: max |logit - T=1| = {err:.1e}, tokens equal "
            f"{lead['tokens'] == ref['tokens']}, in flight {lead['inflight']}, errors {lead['errors'][:2]}")
    log(f"PART3 {len(cases) - bad}/{len(cases)} switch cases ok")


def part4() -> None:
    from helpers_dsa import build_dsa_checkpoint
    from test_dsa_engine import ENGINE, PROMPTS
    from test_engine_switch import run

    from splash.engine.build import build_engine

    for kind in ("v32", "glm"):
        path = build_dsa_checkpoint(tempfile.mkdtemp() + f"/{kind}", kind, seed=3, index_head_dim=48)
        cpu = build_engine(model=path, num_kv_pages=64, **ENGINE)
        cpu_toks, cpu_logits, _ = run(cpu, PROMPTS)
        cpu.shutdown()
        eng = build_engine(model=path, num_kv_pages=64, **dict(ENGINE, device=DEV))
        toks, logits, errors = run(eng, PROMPTS)
        eng.shutdown()
        err = max((logits[k].cpu() - cpu_logits[k]).abs().max().item() for k in cpu_logits)
        log(f"PART4 DSA {kind} T=1 {DEV} float64: tokens == CPU engine: {toks == cpu_toks}; "
            f"max |logit - CPU| = {err:.2e}; accounting errors {errors[:2]}")


if __name__ == "__main__":
    from helpers_ckpt import build_checkpoint

    os.environ.setdefault("SPLASH_COMM", "gloo")
    if DEV == "cuda":
        log(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
    path = build_checkpoint(tempfile.mkdtemp() + "/v3", "v3", seed=5)
    parts = os.environ.get("PARTS", "12,3,4")
    if "1" in parts:
        part1_2(path)
    if "3" in parts:
        part3(path)
    if "4" in parts:
        part4()
