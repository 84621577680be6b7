"""Communicator ops on real gloo ranks (and the one-rank form), byte counters, launch failures."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
from dist_utils import run_ranks

from splash.distributed import shm
from splash.distributed.comm import LocalCommunicator
from splash.distributed.launch import WorkerError, free_port, resolve_launch, spawn_workers, start_workers

pytestmark = pytest.mark.timeout(180)

SHM = shm.supported() and os.path.isdir("/dev/shm")  # where attach can map a segment
needs_shm = pytest.mark.skipif(not SHM, reason="shared-memory collectives need x86-64 Linux and /dev/shm")
W = 3  # odd world: catches code that silently assumes powers of two


def _rows(rank: int, n: int, width: int = 2) -> torch.Tensor:
    """Rank-tagged rows so a misplaced row is visible: value = 100*rank + row + col/10."""
    base = 100.0 * rank + torch.arange(n, dtype=torch.float64)[:, None]
    return base + torch.arange(width, dtype=torch.float64)[None, :] / 10


def _send_counts(rank: int, world: int) -> list[int]:
    """Unequal counts with zeros: rank r sends (r + j) % 3 rows to rank j."""
    return [(rank + j) % 3 for j in range(world)]


def _comm_ops(grid) -> dict:
    comm = grid.comm
    r, w = comm.rank, comm.world
    out: dict = {}
    x = torch.full((4, 3), float(r + 1), dtype=torch.float64)
    out["all_reduce"] = comm.all_reduce(x.clone(), tag=0)
    out["all_reduce_async"] = comm.all_reduce_async(x.clone() * 2, tag=0).wait()
    sizes = [2, 0, 3][:w]
    mine = _rows(r, sizes[r])
    out["gather_known"] = comm.all_gather_var(mine, tag=1, sizes=sizes)
    out["gather_unknown"] = comm.all_gather_var(mine, tag=1)
    out["gather_async"] = comm.all_gather_var_async(mine, tag=1, sizes=sizes).wait()
    out["gather_equal"] = comm.all_gather(torch.full((2, 2), float(r)), tag=1)
    send = _send_counts(r, w)
    blocks = [torch.full((send[j], 2, 2), 10.0 * r + j, dtype=torch.float64) for j in range(w)]
    t = torch.cat(blocks)
    recv = [_send_counts(j, w)[r] for j in range(w)]
    out["a2a_known"] = comm.all_to_all_var(t, send, tag=2, recv_counts=recv)
    out["a2a_unknown"] = comm.all_to_all_var(t, send, tag=2)
    out["a2a_async"] = comm.all_to_all_var_async(t, send, tag=2, recv_counts=recv).wait()
    plan = {"step": 7, "rows": list(range(r + 5))} if r == 0 else None
    out["bcast"] = comm.broadcast_object(plan, src=0)
    big = {"rows": list(range(20000))} if r == 1 else None  # > OBJ_INLINE: needs the second broadcast
    out["bcast_big"] = comm.broadcast_object(big, src=1)
    out["bcast_after"] = comm.broadcast_object(("small", r) if r == 2 else None, src=2)
    out["objects"] = comm.all_gather_object(("rank", r))
    comm.barrier()
    out["bytes"] = dict(comm.stats.current)
    out["type"] = type(comm).__name__
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plane", ["shm", "gloo"])
def test_comm_ops_on_three_ranks(plane: str, monkeypatch) -> None:
    """The same ops and byte counts through the shared-memory data plane (the CPU default) and gloo."""
    res = run_ranks(W, _comm_ops, timeout=120, cpu_comm=plane)  # (--cpu-comm, SPLASH_COMM)
    sizes = [2, 0, 3]
    gathered = torch.cat([_rows(j, sizes[j]) for j in range(W)])
    for r, out in enumerate(res):
        usable = plane == "shm" and SHM
        assert out["type"] == ("ShmCommunicator" if usable else "Communicator")
        assert torch.equal(out["all_reduce"], torch.full((4, 3), 6.0, dtype=torch.float64))
        assert torch.equal(out["all_reduce_async"], torch.full((4, 3), 12.0, dtype=torch.float64))
        for k in ("gather_known", "gather_unknown", "gather_async"):
            assert torch.equal(out[k], gathered), k
        assert torch.equal(out["gather_equal"], torch.arange(W, dtype=torch.float32)[:, None, None]
                           .expand(W, 2, 2))
        expect = torch.cat([torch.full((_send_counts(j, W)[r], 2, 2), 10.0 * j + r, dtype=torch.float64)
                            for j in range(W)])
        for k in ("a2a_known", "a2a_unknown", "a2a_async"):
            assert torch.equal(out[k], expect), k
        assert out["bcast"] == {"step": 7, "rows": [0, 1, 2, 3, 4]}
        assert out["bcast_big"] == {"rows": list(range(20000))} and out["bcast_after"] == ("small", 2)
        assert out["objects"] == [("rank", j) for j in range(W)]
        # Bytes: counted by the convention in splash/distributed/stats.py, recomputed here by hand.
        b = out["bytes"]
        assert b[("all_reduce", 0)] == 2 * (2 * (W - 1) * 4 * 3 * 8 // W)
        assert b[("all_gather", 1)] == 3 * sizes[r] * 2 * 8 * (W - 1) + 2 * 2 * 4 * (W - 1)
        sent_rows = sum(c for j, c in enumerate(_send_counts(r, W)) if j != r)
        assert b[("all_to_all", 2)] == 3 * sent_rows * 2 * 2 * 8
        sent = [{"step": 7, "rows": [0, 1, 2, 3, 4]}, {"rows": list(range(20000))}, ("small", 2)][r]
        nbytes = len(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
        assert b[("broadcast_object", None)] == nbytes * (W - 1)


def _seeded(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    small = torch.randn(4, 3, dtype=torch.float64, generator=g)
    return small, torch.randn(40, 3, dtype=torch.float64, generator=g)


def _small_slots(grid) -> dict:
    """Shared-memory collectives with 256-byte slots: messages over a slot on *any* rank go to gloo on
    every rank (each sees every header), the rest stay in shared memory; results are the same."""
    c = shm.attach(grid.group, grid.rank, grid.world, grid.control, timeout_s=60, slot_bytes=256)
    r, w = grid.rank, grid.world
    out: dict = {"none": c is None}
    if c is None:
        return out
    small, big = _seeded(r)
    out["small_sum"] = c.all_reduce(small.clone())
    out["big_sum"] = c.all_reduce(big.clone())
    out["after_small"] = c.fallbacks
    rows = _rows(r, 20 if r == 0 else 1)  # 320 bytes on rank 0 only
    out["gather"] = c.all_gather_var(rows)
    send = [1, 12][:w] if r == 1 else [1, 1][:w]  # rank 1 sends 13 x 32 bytes
    out["a2a"] = c.all_to_all_var(torch.cat([torch.full((n, 2, 2), 10.0 * r + j, dtype=torch.float64)
                                             for j, n in enumerate(send)]), send)
    out["fallbacks"] = c.fallbacks
    c.close()
    return out


@pytest.mark.slow
@needs_shm
def test_shm_messages_over_a_slot_fall_back_to_gloo_on_every_rank() -> None:
    res = run_ranks(2, _small_slots, timeout=120)
    sums = [_seeded(r) for r in range(2)]
    for r, out in enumerate(res):
        assert not out["none"]
        assert torch.equal(out["small_sum"], sums[0][0] + sums[1][0])
        assert torch.allclose(out["big_sum"], sums[0][1] + sums[1][1], rtol=0, atol=1e-12)
        assert out["after_small"] == 1  # the 960-byte all_reduce went to gloo, the 96-byte one did not
        assert torch.equal(out["gather"], torch.cat([_rows(0, 20), _rows(1, 1)]))
        expect = [torch.full(([1, 1][r] if j == 0 else [1, 12][r], 2, 2), 10.0 * j + r, dtype=torch.float64)
                  for j in range(2)]
        assert torch.equal(out["a2a"], torch.cat(expect))
        assert out["fallbacks"] == 3
    assert torch.equal(res[0]["small_sum"], res[1]["small_sum"])  # bit-identical on every rank
    assert torch.equal(res[0]["big_sum"], res[1]["big_sum"])


def _shm_edges(grid) -> dict:
    r = grid.rank
    out: dict = {}
    # one rank unwilling (SPLASH_COMM=gloo there, or another host): every rank keeps gloo, nobody hangs
    out["mixed"] = shm.attach(grid.group, r, grid.world, grid.control, timeout_s=30, enabled=(r == 0))
    c = shm.attach(grid.group, r, grid.world, grid.control, timeout_s=30, slot_bytes=256)
    for rows in (8, 64):  # 64 B in shared memory; 512 B through gloo's fallback
        buf = torch.arange(2 * rows, dtype=torch.float64).reshape(rows, 2) * (r + 1)
        col = buf[:, 0]  # a strided view: only its own elements may change
        c.all_reduce(col)
        out[f"strided{rows}"] = buf
    out["int64"] = c.all_gather_var(torch.full((r + 1, 3), 7 * r, dtype=torch.int64))
    out["bf16"] = c.all_to_all_var(torch.full((2, 4), r + 0.5, dtype=torch.bfloat16), [1, 1])
    try:  # ranks disagree on the size: both must fail, not read each other's stale bytes
        c.all_reduce(torch.ones(4 if r == 0 else 8, dtype=torch.float64))
        out["mismatch"] = "no error"
    except RuntimeError as e:
        out["mismatch"] = str(e)
    try:
        c.all_reduce(torch.ones(4, dtype=torch.float64))
        out["after"] = "no error"
    except RuntimeError as e:
        out["after"] = str(e)
    c.close()
    return out


@pytest.mark.slow
@needs_shm
def test_shm_edges_strided_dtypes_mismatch_and_mixed_ranks() -> None:
    res = run_ranks(2, _shm_edges, timeout=120)
    for r, out in enumerate(res):
        assert out["mixed"] is None
        for rows in (8, 64):
            base = torch.arange(2 * rows, dtype=torch.float64).reshape(rows, 2)
            want = base * (r + 1)
            want[:, 0] = base[:, 0] * 3  # summed over ranks 1x and 2x; column 1 untouched
            assert torch.equal(out[f"strided{rows}"], want), rows
        assert torch.equal(out["int64"], torch.tensor([[0] * 3, [7] * 3, [7] * 3]))
        assert torch.equal(out["bf16"], torch.tensor([[0.5] * 4, [1.5] * 4], dtype=torch.bfloat16))
        assert "different calls" in out["mismatch"]
        assert "unusable" in out["after"]


def test_local_communicator_is_identity() -> None:
    comm = LocalCommunicator()
    x = torch.randn(3, 2)
    assert comm.all_reduce(x) is x
    assert comm.all_gather_var(x, sizes=[3]) is x
    assert torch.equal(comm.all_gather(x), x[None])
    assert comm.all_to_all_var(x, [3]) is x
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    assert comm.all_gather_object(5) == [5]
    assert comm.stats.total_bytes() == 0
    with pytest.raises(ValueError, match="row counts"):
        comm.all_to_all_var(x, [2, 1])


# ---- failures are loud and bounded ----------------------------------------------------------------
def _raise_on_rank1(grid) -> int:
    if grid.rank == 1:
        raise ValueError("boom on purpose")
    return grid.rank


def _rank0_exits(grid, path: str) -> None:
    """Rank 0 leaves after one message: rank 1, waiting for the next one with no deadline (ranks sit
    idle between requests), must notice rank 0 gone and say so, not wait for ever."""
    c = shm.attach(grid.group, grid.rank, grid.world, grid.control, timeout_s=60)
    c.broadcast_object("hello" if grid.rank == 0 else None, src=0)
    c.all_reduce(torch.ones(2))  # rank 1 has read it before rank 0 leaves
    if grid.rank == 0:
        os._exit(0)
    t0 = time.monotonic()
    try:
        c.broadcast_object(None, src=0)
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    with open(path, "w") as f:
        f.write(f"{time.monotonic() - t0:.2f} {msg}")


@pytest.mark.slow
@needs_shm
def test_shm_mailbox_wait_notices_rank0_gone(tmp_path) -> None:
    path = str(tmp_path / "rank1.txt")
    with pytest.raises(WorkerError):  # rank 0 exits without a result, on purpose
        run_ranks(2, _rank0_exits, path, timeout=60)
    waited, msg = open(path).read().split(" ", 1)
    assert "rank 0" in msg and "exited" in msg, msg
    assert float(waited) < 5


MAIL_MSGS = [("plan", 1), {"rows": list(range(500))}, b"x" * 40, ("after", 3)]  # the second: over 64 B


def _mailbox(grid) -> dict:
    """Rank 0's messages through a 64-byte mailbox: small ones inline, a larger one announced there and
    sent over gloo, in order; another rank's broadcast on gloo; a wait through rank 0's 1.5 s pause."""
    c = shm.attach(grid.group, grid.rank, grid.world, grid.control, timeout_s=60, slot_bytes=256,
                   mail_bytes=64)
    r = grid.rank
    out = {"got": [c.broadcast_object(m if r == 0 else None, src=0) for m in MAIL_MSGS],
           "gloo_from_1": c.broadcast_object(("one", r) if r == 1 else None, src=1)}
    if r == 0:
        time.sleep(1.5)
    out["late"] = c.broadcast_object("late" if r == 0 else None, src=0)
    out["bytes"] = dict(c.stats.current)
    out["m"] = c._m
    c.close()
    return out


@pytest.mark.slow
@needs_shm
def test_shm_mailbox_inline_and_over_gloo_in_order() -> None:
    res = run_ranks(2, _mailbox, timeout=60)
    for out in res:
        assert out["got"] == MAIL_MSGS and out["gloo_from_1"] == ("one", 1) and out["late"] == "late"
        assert out["m"] == 5  # rank 0's five messages took the mailbox (one of them announced gloo)
    sent = sum(len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) for m in MAIL_MSGS + ["late"])
    assert res[0]["bytes"][("broadcast_object", None)] == sent  # world 2: each byte sent once


def _hang_rank1(grid) -> None:
    if grid.rank == 1:
        time.sleep(60)  # never joins the collective below
    grid.comm.all_reduce(torch.ones(2))


def _die_rank1(grid) -> None:
    if grid.rank == 1:
        os._exit(3)
    grid.comm.all_reduce(torch.ones(2))


@pytest.mark.slow
def test_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(WorkerError) as e:
        run_ranks(2, _raise_on_rank1, timeout=60)
    assert e.value.rank == 1 and "boom on purpose" in str(e.value)
    assert "_raise_on_rank1" in e.value.remote_traceback


@pytest.mark.slow
def test_hung_rank_fails_within_collective_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        spawn_workers(2, _hang_rank1, timeout_s=90, backend="gloo", collective_timeout_s=4)
    assert e.value.rank == 0  # the waiting rank times out in its collective and says so
    assert time.monotonic() - t0 < 50


@pytest.mark.slow
def test_dead_rank_fails_loudly() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError):
        spawn_workers(2, _die_rank1, timeout_s=60, backend="gloo", collective_timeout_s=20)
    assert time.monotonic() - t0 < 55


# ---- joining from two "nodes" and launch flags ----------------------------------------------------
def _sum_ranks(grid) -> float:
    return float(grid.comm.all_reduce(torch.tensor([float(grid.rank + 1)]))[0])


@pytest.mark.slow
def test_two_nodes_join_one_grid() -> None:
    addr = f"127.0.0.1:{free_port()}"
    specs = [resolve_launch(2, nnodes=2, node_rank=n, dist_init_addr=addr, env={}) for n in (0, 1)]
    assert specs[0].ranks == (0,) and specs[1].ranks == (1,)
    nodes = [start_workers(s.world, _sum_ranks, ranks=s.ranks, init_method=s.init_method,
                           backend="gloo", timeout_s=60, threads=1) for s in specs]
    done = {}
    for node in nodes:
        done.update(node.join(90))
    assert done == {0: 3.0, 1: 3.0}


def test_resolve_launch_flags() -> None:
    s = resolve_launch(4, env={})
    assert s.world == 4 and s.ranks == (0, 1, 2, 3) and s.init_method.startswith("tcp://127.0.0.1:")
    s = resolve_launch(4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000", env={})
    assert s.ranks == (2, 3) and s.init_method == "tcp://10.0.0.1:5000"
    tr = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    s = resolve_launch(None, env=tr)
    assert s.torchrun and s.ranks == (1,) and s.world == 2 and s.init_method == "env://"
    for kw, msg in [({"tp": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "split evenly"),
                    ({"tp": 2, "nnodes": 2}, "dist-init-addr"),
                    ({"tp": 2, "dist_init_addr": "nohostport"}, "HOST:PORT"),
                    ({"tp": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node-rank")]:
        with pytest.raises(ValueError, match=msg):
            resolve_launch(env={}, **kw)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        resolve_launch(4, env=tr)


def _follow_plans(grid) -> list[int]:
    """A worker loop in miniature: receive plans until shutdown, reduce something per plan."""
    seen = []
    while True:
        plan = grid.comm.broadcast_object(None, src=0)
        if plan == "shutdown":
            return seen
        seen.append(int(grid.comm.all_reduce(torch.tensor([float(plan)]), tag="plan")[0]))


@pytest.mark.slow
def test_leader_in_process_with_spawned_workers() -> None:
    """The engine's shape: rank 0 stays in this process (scheduler, server), ranks 1.. are children."""
    from splash.distributed.groups import init_distributed

    world, init = 3, f"tcp://127.0.0.1:{free_port()}"
    workers = start_workers(world, _follow_plans, ranks=[1, 2], init_method=init, backend="gloo",
                            timeout_s=60, threads=1)
    grid = init_distributed(0, world, init, backend="gloo", timeout_s=60)
    try:
        got = []
        for p in (1, 2, 5):
            grid.comm.broadcast_object(p)
            got.append(int(grid.comm.all_reduce(torch.tensor([float(p)]), tag="plan")[0]))
            workers.poll()  # a dead worker would raise here
        grid.comm.broadcast_object("shutdown")
        done = workers.join(60)
    finally:
        grid.destroy()
        workers.terminate()
    assert got == [3, 6, 15] and done == {1: got, 2: got}
    assert grid.comm.stats.total_bytes("broadcast_object") > 0
