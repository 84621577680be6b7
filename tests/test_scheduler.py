"""Scheduler without a model: a fake KV cache written through the plans' page tables checks that every
slice sees exactly its own history (also after preemption), and a fake next-token rule checks that
outputs match generation one request at a time."""

import random

import pytest

from splash.engine.request import Request, SeqStatus, Sequence
from splash.engine.sampling import SamplingParams
from splash.engine.scheduler import Scheduler, SchedulerConfig
from splash.kv.allocator import KVAllocator


def next_token(prefix: list[int]) -> int:
    h = 7
    for t in prefix:
        h = (h * 31 + t) % 1000003
    return h % 50 + 1


def reference(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def make_seq(prompt, max_tokens):
    req = Request(request_id="r", prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens))
    seq = Sequence(group=req, index=0)
    req.seqs.append(seq)
    return seq


def run(sched: Scheduler, arrivals: dict[int, list[Sequence]], world: int, page_size: int,
        max_steps: int = 10_000) -> list[tuple[int, int]]:
    """Drive the scheduler; return (rows, seqs) per step. Asserts the KV view of every slice."""
    kv = [dict() for _ in range(world)]  # rank -> local page -> {slot: token}
    shapes = []
    step = 0
    while sched.has_unfinished() or any(k >= step for k in arrivals):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        st = sched.schedule()
        st.plan.validate(page_size, world)
        assert st.plan.num_rows <= sched.cfg.max_num_batched_tokens
        assert len(sched.running) <= sched.cfg.max_num_seqs
        by_id = {s.seq_id: s for s in st.seqs}
        row = 0
        for sl in st.plan.seqs:
            seq = by_id[sl.req_id]
            toks = seq.token_slice(0, sl.end)
            assert st.plan.input_ids[row:row + sl.num_new] == toks[sl.start:]
            row += sl.num_new
            for r in range(world):
                for p in range(sl.start):  # history visible on the ranks that hold it
                    local = sl.pages[r][p // page_size]
                    if local != -1:
                        assert kv[r][local][p % page_size] == toks[p]
                for p in range(sl.start, sl.end):  # write the new rows
                    local = sl.pages[r][p // page_size]
                    if local != -1:
                        kv[r].setdefault(local, {})[p % page_size] = toks[p]
            if world > 1 and st.plan.layout == "cp":
                assert all(any(sl.pages[r][j] != -1 for r in range(world)) for j in range(len(sl.pages[0])))
        sched.complete(st)
        for seq, sl in zip(st.seqs, st.plan.seqs):
            if sl.sample and seq.status is SeqStatus.RUNNING:
                seq.output_token_ids.append(next_token(seq.token_slice(0, seq.num_tokens)))
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish("length")
                    sched.free(seq)
        shapes.append((st.plan.num_rows, len(st.plan.seqs)))
        step += 1
        assert step < max_steps, "scheduler made no progress"
    return shapes


@pytest.mark.parametrize("layout,world", [("tp", 1), ("tp", 2), ("dp", 2), ("cp", 4), ("dop", 2)])
def test_chunked_prefill_continuous_batching_matches_reference(layout, world):
    rng = random.Random(0)
    P = 4
    alloc = KVAllocator(64, page_size=P, world=world, layout=layout)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512), alloc)
    arrivals: dict[int, list[Sequence]] = {}
    seqs = []
    for i in range(10):
        s = make_seq([rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 20))
        arrivals.setdefault(i * 3, []).append(s)
        seqs.append(s)
    shapes = run(sched, arrivals, world, P)
    for s in seqs:
        assert s.output_token_ids == reference(s.prompt_token_ids, s.params.max_tokens)
    assert alloc.num_used == [0] * world
    assert any(rows > n for rows, n in shapes), "expected prefill chunks in some steps"
    assert max(n for _, n in shapes) == 4


def test_preemption_by_recompute_and_queueing():
    P = 2
    alloc = KVAllocator(12, page_size=P)  # 24 tokens for everyone
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=512), alloc)
    seqs = [make_seq(list(range(1 + i, 7 + i)), 12) for i in range(4)]  # 4 x 18 tokens > 24
    run(sched, {0: seqs}, 1, P)
    for s in seqs:
        assert s.output_token_ids == reference(s.prompt_token_ids, 12)
    assert sched.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions
    assert alloc.num_used == [0]


def test_decode_first_then_prefill_chunks():
    alloc = KVAllocator(100, page_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=512), alloc)
    a = make_seq([1, 2, 3], 5)
    sched.add(a)
    st = sched.schedule()
    sched.complete(st)
    a.output_token_ids.append(9)
    b = make_seq(list(range(1, 30)), 5)
    sched.add(b)
    st = sched.schedule()
    got = [(s.req_id, s.num_new, s.sample) for s in st.plan.seqs]
    assert got == [(a.seq_id, 1, True), (b.seq_id, 9, False)]
    sched.complete(st)
    a.output_token_ids.append(9)
    st = sched.schedule()  # b continues its prefill after a's decode
    assert [(s.req_id, s.start, s.num_new) for s in st.plan.seqs] == [(a.seq_id, 4, 1), (b.seq_id, 9, 9)]


def test_request_filling_the_whole_pool_finishes_with_length():
    alloc = KVAllocator(3, page_size=2)  # 6 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=512), alloc)
    s = make_seq([1, 2, 3], 100)
    run(sched, {0: [s]}, 1, 2)
    assert s.finish_reason == "length" and s in sched.finished_by_scheduler
    assert s.num_tokens == 7 and alloc.num_used == [0]


def test_queue_waits_for_pages_instead_of_failing():
    alloc = KVAllocator(4, page_size=4)  # 16 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512), alloc)
    a, b = make_seq(list(range(1, 11)), 2), make_seq(list(range(1, 11)), 2)
    sched.add(a)
    sched.add(b)
    st = sched.schedule()
    assert [s.req_id for s in st.plan.seqs] == [a.seq_id] and list(sched.waiting) == [b]


def test_step_mixing_bounds_rows_per_step_and_keeps_decodes_running():
    """A long prompt arriving while streams decode: every step carries every running stream's decode
    row first, the prompt's chunk fills only what the budget leaves, and no step exceeds the budget;
    with long_prefill_token_threshold two prompts share a step instead of the older taking it all."""
    budget, streams = 16, 4
    alloc = KVAllocator(200, page_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512),
                      alloc)
    decoders = [make_seq([i + 1, i + 2], 40) for i in range(streams)]
    for s in decoders:
        sched.add(s)
    st = sched.schedule()
    sched.complete(st)
    for s in decoders:
        s.output_token_ids.append(7)
    long = make_seq(list(range(1, 101)), 2)  # 100 prompt tokens
    sched.add(long)
    chunks = []
    for _ in range(8):
        st = sched.schedule()
        ids = [sl.req_id for sl in st.plan.seqs]
        assert ids[:streams] == [s.seq_id for s in decoders], "decode rows must come first, every step"
        assert all(sl.num_new == 1 for sl in st.plan.seqs[:streams])
        assert st.plan.num_rows <= budget
        chunks += [sl.num_new for sl in st.plan.seqs if sl.req_id == long.seq_id]
        sched.complete(st)
        for s in decoders:
            s.output_token_ids.append(7)
    assert chunks[:7] == [budget - streams] * 7  # the prompt takes exactly what the decodes leave

    # Two prompts queued together: without the cap the first takes the whole budget for steps, with it
    # both advance in the same step (vLLM's --long-prefill-token-threshold).
    for cap, want in ((0, [(0, 16)]), (8, [(0, 8), (0, 8)])):
        alloc = KVAllocator(200, page_size=4)
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512,
                              long_prefill_token_threshold=cap)
        sched = Scheduler(cfg, alloc)
        for i in range(2):
            sched.add(make_seq(list(range(1 + i, 60 + i)), 2))
        st = sched.schedule()
        assert [(sl.start, sl.num_new) for sl in st.plan.seqs] == want
        assert cfg.chunk(3, 100) == 3 and cfg.chunk(50, 5) == 5  # the cap is only an upper bound
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("cap", [5, 16])
def test_long_prefill_cap_keeps_tokens_exact(cap):
    """The per-sequence cap changes how prompts are chunked, never what is computed."""
    P = 4
    alloc = KVAllocator(60, page_size=P)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=512,
                                      long_prefill_token_threshold=cap), alloc)
    seqs = [make_seq(list(range(1 + i, 30 + 3 * i)), 6) for i in range(3)]
    chunks: list[int] = []
    schedule = sched.schedule

    def spy():
        st = schedule()
        chunks.extend(sl.num_new for sl in st.plan.seqs)
        return st

    sched.schedule = spy
    run(sched, {0: seqs[:2], 3: seqs[2:]}, 1, P)
    for s in seqs:
        assert s.output_token_ids == reference(s.prompt_token_ids, 6)
    assert max(chunks) == cap and alloc.num_used == [0]


def test_default_token_budget_follows_vllms_cpu_defaults():
    """A server takes vLLM's CPU server default, 2048 x T (a wave of prompts prefills in one step);
    offline keeps max(512, max_num_seqs); neither is ever below max_num_seqs (every decode fits)."""
    from splash.config import default_token_budget

    assert default_token_budget(1, 64, serving=True) == 2048
    assert default_token_budget(2, 64, serving=True) == 4096
    assert default_token_budget(1, 4096, serving=True) == 4096
    assert default_token_budget(1, 64, serving=False) == 512
    assert default_token_budget(4, 1000, serving=False) == 1000


def test_a_server_runs_128_sequences_by_default_offline_64():
    """`max_num_seqs` unset: a server engine takes vLLM's CPU server default, 128 x T; an offline one 64;
    a value given is kept either way."""
    from splash.config import default_max_num_seqs
    from splash.engine.build import build_engine

    assert default_max_num_seqs(1, serving=True) == 128 and default_max_num_seqs(2, serving=True) == 256
    for serving, want in ((True, 128), (False, 64)):
        eng = build_engine("tiny", dtype="float32", num_kv_pages=64, serving=serving)
        assert eng.scheduler.cfg.max_num_seqs == want and eng.stats()["max_num_seqs"] == want
        eng.shutdown()
    eng = build_engine("tiny", dtype="float32", num_kv_pages=64, serving=True, max_num_seqs=8)
    assert eng.scheduler.cfg.max_num_seqs == 8
    eng.shutdown()
