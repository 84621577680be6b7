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
