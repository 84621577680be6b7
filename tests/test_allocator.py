"""Page allocators: free lists per rank, the layout placement rule, all-or-nothing growth, no leaks."""

import pytest

from splash.kv.allocator import KVAllocator, OutOfPages, PageAllocator, page_ranks, pages_for


def test_page_allocator_alloc_free_and_double_free():
    a = PageAllocator(4)
    got = a.alloc(3)
    assert sorted(got) == [0, 1, 2] and a.num_free == 1 and a.num_used == 3
    with pytest.raises(OutOfPages):
        a.alloc(2)
    a.free(got[:2])
    assert a.num_free == 3
    with pytest.raises(RuntimeError, match="twice"):
        a.free([got[0]])


def _runs(pages):
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1)


def test_pages_come_out_in_runs_best_fit():
    """A PD transfer moves one piece per run of pages: `alloc(n)` takes the shortest free run holding n
    (holes of 2 and 5 pages: 2 pages come from the first, 4 from the second, 6 from the tail), one at a
    time fills the shortest hole, and freed neighbours join again."""
    a = PageAllocator(32)
    held = [a.alloc(n) for n in (3, 2, 4, 5, 6)]  # pages 0-2, 3-4, 5-8, 9-13, 14-19
    assert [_runs(h) for h in held] == [1] * 5 and held[1] == [3, 4]
    a.free(held[1])  # hole 3-4
    a.free(held[3])  # hole 9-13
    assert a.alloc(2) == [3, 4] and a.alloc(4) == [9, 10, 11, 12] and a.alloc(6) == list(range(20, 26))
    assert a.alloc(1) == [13]  # (the shortest run: the hole's last page, not the tail)
    a.free(list(range(20, 26)))
    a.free([13, 9, 11, 10, 12])
    assert a.alloc(5) == list(range(9, 14))  # the hole joined back into one run
    # no run long enough: the longest runs in turn, as few pieces as there can be
    b = PageAllocator(10)
    x = b.alloc(10)
    b.free(x[0:3] + x[5:7] + x[8:10])
    assert _runs(b.alloc(6)) == 3 and b.num_free == 1


def test_churn_keeps_the_books_and_grow_takes_a_run():
    import random

    rng = random.Random(0)
    a = PageAllocator(500)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            a.free(held.pop(rng.randrange(len(held))))
        elif (n := rng.choice([1, 1, 4, 12, 64])) <= a.num_free:
            held.append(a.alloc(n))
        free = a._free
        assert len(free) == len(set(free)) == a.num_free == 500 - sum(map(len, held))
        assert not any(a._used[p] for p in free) and sum(a._used) == 500 - a.num_free
    # a growing table takes its new pages of each rank in one run
    k = KVAllocator(40, 4, world=2, layout="tp")
    t = k.empty_table()
    k.grow(t, 4, 0)
    k.grow(t, 40, 0)
    assert all(_runs(row[1:]) == 1 for row in t)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_placement_rule(world):
    for j in range(9):
        assert page_ranks("tp", j, 1 % world, world) == tuple(range(world))
        assert page_ranks("dp", j, world - 1, world) == (world - 1,)
        assert page_ranks("dop", j, 0, world) == (0,)
        assert page_ranks("cp", j, 0, world) == (j % world,)
    # The switch planner evaluates the rule for pages 0..T-1 and tiles it: every layout's placement
    # must depend on the page index only through j % T.
    for layout in ("tp", "dp", "cp", "dop"):
        for owner in range(world):
            for j in range(4 * world):
                assert page_ranks(layout, j, owner, world) == page_ranks(layout, j % world, owner, world)
    with pytest.raises(ValueError, match="layout"):
        page_ranks("ep", 0, 0, world)


@pytest.mark.parametrize("layout", ["tp", "dp", "cp", "dop"])
def test_tables_follow_placement_and_release_everything(layout):
    world, P = 4, 4
    alloc = KVAllocator(10, page_size=P, world=world, layout=layout)
    tables = []
    for owner, tokens in [(1, 9), (2, 13), (3, 1)]:
        t = alloc.empty_table()
        alloc.grow(t, tokens, owner)
        assert all(len(row) == pages_for(tokens, P) for row in t)
        for j in range(pages_for(tokens, P)):
            holders = {r for r in range(world) if t[r][j] != -1}
            assert holders == set(page_ranks(layout, j, owner, world))
        tables.append(t)
    # Local page ids are unique per rank across all requests.
    for r in range(world):
        ids = [p for t in tables for p in t[r] if p != -1]
        assert len(ids) == len(set(ids)) == alloc.num_used[r]
    for t in tables:
        alloc.release(t)
    assert alloc.num_used == [0] * world and alloc.num_free == [10] * world


def test_grow_is_all_or_nothing_and_demand_is_per_rank():
    alloc = KVAllocator([3, 1], page_size=2, world=2, layout="cp")
    t = alloc.empty_table()
    assert alloc.demand(t, 8, owner=0) == [2, 2]
    assert not alloc.can_grow(t, 8, owner=0)
    with pytest.raises(OutOfPages):
        alloc.grow(t, 8, owner=0)
    assert alloc.num_used == [0, 0] and t == [[], []]
    alloc.grow(t, 4, owner=0)  # pages 0 -> rank 0, 1 -> rank 1
    assert alloc.num_used == [1, 1] and t[0][1] == -1 and t[1][0] == -1
    assert alloc.can_grow(t, 6, owner=0) and not alloc.can_grow(t, 8, owner=0)


def test_max_request_tokens_per_layout():
    assert KVAllocator(8, 4, world=2, layout="tp").max_request_tokens() == 32
    assert KVAllocator(8, 4, world=2, layout="dp").max_request_tokens() == 32
    assert KVAllocator(8, 4, world=2, layout="cp").max_request_tokens() == 64
