"""Binding a node's ranks to disjoint CPU cores: the plan, and a real T=2 group bound and unbound."""

from __future__ import annotations

import os

import pytest

from splash.distributed import affinity


def test_plan_gives_each_rank_its_own_cores(monkeypatch) -> None:
    monkeypatch.delenv(affinity.ENV, raising=False)
    assert affinity.plan(2, 1, [3, 1]) == [(1,), (3,)]
    assert affinity.plan(2, 2, range(5)) == [(0, 1), (2, 3)]
    assert affinity.plan(4, 1, range(2)) is None  # T=4 on 2 cores: oversubscribed, leave it to the OS
    assert affinity.plan(2, 2, range(3)) is None
    assert affinity.plan(1, 2, range(2)) is None  # one rank may use every core
    assert affinity.for_ranks([0, 1], 1, "nccl") == {}  # GPU ranks: never bound


def test_plan_can_be_turned_off_and_rejects_an_unknown_mode(monkeypatch) -> None:
    from splash.config import EngineConfig

    def mode() -> str:  # the engine's cpu_bind, SPLASH_CPU_BIND read into it when a config is made
        return EngineConfig.from_kwargs().cpu_bind

    monkeypatch.setenv(affinity.ENV, "off")
    assert affinity.plan(2, 1, range(2), mode()) is None
    assert affinity.plan(2, 1, range(2), "off") is None  # (--cpu-bind off)
    monkeypatch.setenv(affinity.ENV, "sideways")
    with pytest.raises(ValueError, match="SPLASH_CPU_BIND"):
        affinity.plan(2, 1, range(2), mode())
    with pytest.raises(ValueError, match="SPLASH_CPU_BIND"):
        affinity.plan(2, 1, range(2), "sideways")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores")
def test_a_t2_group_binds_each_rank_to_its_core_and_rank_0_unbinds_on_close(monkeypatch) -> None:
    from splash.engine.group import RankGroup

    monkeypatch.delenv(affinity.ENV, raising=False)
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    g = RankGroup.start(2, device="cpu", timeout_s=60.0, threads=1)
    try:
        assert os.sched_getaffinity(0) == {cores[0]}
        worker = g.workers.procs[1].pid
        assert os.sched_getaffinity(worker) == {cores[1]}
    finally:
        g.close()
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores")
def test_bind_holds_for_the_calling_thread_only_and_restore_undoes_it_from_another() -> None:
    """The server builds its engine on its own thread: binding it must leave the event loop's free."""
    import threading

    before = os.sched_getaffinity(0)
    core = min(before)
    bound, ready, done = [], threading.Event(), threading.Event()

    def engine_thread() -> None:
        bound.append(affinity.bind([core]))
        ready.set()
        done.wait(30)

    t = threading.Thread(target=engine_thread)
    t.start()
    try:
        assert ready.wait(30)
        tid, was = bound[0]
        assert os.sched_getaffinity(tid) == {core} and was == before
        assert os.sched_getaffinity(0) == before  # this thread was left alone
        affinity.restore(bound[0])
        assert os.sched_getaffinity(tid) == before
    finally:
        done.set()
        t.join()
    affinity.restore(bound[0])  # the thread has ended: nothing to undo, and no error
