"""Every rank's own page tables through the ENGINE on T = 2 and T = 4 gloo ranks (splash/step/wire.py).

Steps carry only deltas, so after every step each rank's stored tables must equal rank 0's full
tables (`Sequence.pages[r]`) of every running request, and hold nothing else but requests whose drop
is still pending (finished, aborted or preempted since the last step; the next step drops them).
Driven through chunked prefill, decode, preemption and recompute on a tight pool, an abort, and
forced switches in all 12 directions (a switch ships every live table once). Greedy tokens equal the
single-rank engine's (float64), and `decode_plan_bytes_p50` equals the control plane's count of the
decode steps' messages and stays within 128 B per running request + 4 KiB.
"""

from __future__ import annotations

import statistics

import pytest

from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

P = 4
NEW = 8
PROMPTS = [[5, 6, 7], list(range(10, 31)), list(range(3, 12)), [90, 1, 33, 4, 8, 61], list(range(40, 54)),
           [17, 18, 2, 44, 71, 9, 9, 13, 60, 12, 50]]
ENGINE = dict(model="tiny", dtype="float64", page_size=P, max_num_seqs=8, max_num_batched_tokens=8,
              device="cpu")
CIRCUIT = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
ALL12 = ",".join(f"{i + 2}:{lay}" for i, lay in enumerate(CIRCUIT[1:]))


@pytest.fixture(scope="module")
def reference():
    eng = build_engine(num_kv_pages=256, **ENGINE)
    try:
        return run(eng, PROMPTS)[0]
    finally:
        eng.shutdown()


def table_errors(eng) -> list[str]:
    """Each rank's tables == rank 0's for every running request; anything else is a pending drop."""
    tabs = eng.runner.rank_tables()
    known = eng.runner.encoder.known
    pending = set(eng.scheduler.dropped)
    live = {s.seq_id: s for s in eng.scheduler.running if s.pages and s.pages[0]}
    errs = [f"request {rid} runs but no rank was sent its table" for rid in live if rid not in known]
    for r, t in enumerate(tabs):
        if set(t) != set(known):
            errs.append(f"rank {r} holds {sorted(t)}, rank 0 shipped {sorted(known)}")
        for rid, row in t.items():
            if rid in live:
                if row != live[rid].pages[r]:
                    errs.append(f"rank {r} request {rid}: {row} != rank 0's {live[rid].pages[r]}")
            elif rid not in pending:
                errs.append(f"rank {r} keeps the table of request {rid}, which is gone and not being dropped")
    return errs


def run(eng, prompts, abort_at: int | None = None, check: bool = False):
    """Greedy tokens per prompt (None for the aborted one) and the table errors after every step."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params=params)
    done: dict[int, list[int] | None] = {}
    errors: list[str] = []
    while eng.has_unfinished():
        if abort_at is not None and eng.steps == abort_at:
            eng.abort("1")
            done[1] = None
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
        if check:
            errors += [f"step {eng.steps}: {e}" for e in table_errors(eng)]
    return [done[i] for i in range(len(prompts))], errors


def flush_check(eng) -> None:
    """Once everything finished, only pending drops remain; the next step leaves only its request."""
    assert set(eng.runner.encoder.known) <= set(eng.scheduler.dropped)
    toks, errors = run(eng, [[3, 1, 4]], check=True)
    assert not errors, errors[:5]
    tabs = eng.runner.rank_tables()
    assert all(set(t) <= set(eng.scheduler.dropped) for t in tabs), tabs


def test_tables_follow_rank0_through_all_switches(group, reference):
    eng = build_engine(layout="tp", rank_group=group, num_kv_pages=128, switch_schedule=ALL12, **ENGINE)
    try:
        toks, errors = run(eng, PROMPTS, abort_at=5, check=True)
        st = eng.stats()
        assert not errors, errors[:5]
        assert st["num_switches"] == 12 and st["switch_refusals"] == 0
        assert [t for i, t in enumerate(toks) if i != 1] == [t for i, t in enumerate(reference) if i != 1]
        flush_check(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("layout", ["tp", "dp", "cp"])
def test_tables_follow_rank0_through_preemption(group, reference, layout):
    """A pool far smaller than the batch needs (12 requests of 3-8 pages each): requests are
    preempted (tables dropped everywhere) and recomputed under the same id (shipped again)."""
    pages = {"tp": 12, "dp": 8, "cp": 16 // group.world}[layout]
    eng = build_engine(layout=layout, rank_group=group, num_kv_pages=pages, **ENGINE)
    try:
        toks, errors = run(eng, PROMPTS * 2, abort_at=9, check=True)
        st = eng.stats()
        assert not errors, errors[:5]
        if (layout, group.world) != ("dp", 4):  # (4 owners of 8 pages each are roomy enough here)
            assert st["num_preemptions"] > 0, "the pool was meant to be tight enough to preempt"
        assert [t for i, t in enumerate(toks) if i != 1] == \
            [reference[i % len(PROMPTS)] for i in range(2 * len(PROMPTS)) if i != 1]
        flush_check(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_decode_plan_bytes_stat(group, layout):
    """The stat is the median of what the control plane carried in decode steps, and within target."""
    eng = build_engine(layout=layout, rank_group=group, num_kv_pages=256, **{**ENGINE, "max_num_seqs": 16,
                                                                             "max_num_batched_tokens": 64})
    T = group.world
    cs = eng.runner.local.comm.stats
    seen: list[int] = []

    def hook(info):
        if info["rows"] == info["sampled"]:
            seen.append(cs.current[("broadcast_object", None)] // (T - 1))

    eng.on_step.append(hook)
    try:
        prompts = [list(range(1 + i, 40 + i)) for i in range(16)]
        run(eng, prompts)
        p50 = eng.stats()["decode_plan_bytes_p50"]
    finally:
        eng.shutdown()
    assert seen and p50 == statistics.median_low(seen)
    assert 40 < p50 <= 128 * 16 + 4096
