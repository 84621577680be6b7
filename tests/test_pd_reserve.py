"""A decode server reserves a transferred request's pages by its own layout's capacity rule (issue 47):
`Scheduler.reserve` grows the request's table as the allocator places pages in the decode's layout, so
on the same memory per rank DOP (a request's pages on its owner, the projections head-sharded: no
replica withholds pages) parks more prompts than DP-attention (pages on the owner too, but each rank
withholds pages for its projection replicas), and takes a prompt longer than a DP-attention rank's pool,
which DP-attention refuses by name."""

from __future__ import annotations

import pytest
from test_books import FakeRL, fake_engine

from splash.engine.sampling import SamplingParams

PAGES, WEIGHT_PAGES = 12, 2  # per rank; DP withholds 2 for its projection replicas


def decode(layout: str) -> FakeRL:
    return fake_engine(2, pages=PAGES, max_num_seqs=16, budget=16, weight_pages=WEIGHT_PAGES, layout=layout)


def parked(eng: FakeRL, tokens: int) -> int:
    n = 0
    while True:
        req = eng.new_request(f"r{n}", params=SamplingParams(max_tokens=4),
                              prompt_token_ids=list(range(tokens)))
        if not eng.scheduler.reserve(req.seqs[0]):
            eng.requests.pop(req.request_id, None)
            return n
        n += 1


def test_dop_parks_more_than_dp_attention_on_the_same_memory():
    dp, dop = decode("dp"), decode("dop")
    assert dp.allocator.num_free == [PAGES - WEIGHT_PAGES] * 2 and dop.allocator.num_free == [PAGES] * 2
    assert (parked(dp, 12), parked(dop, 12)) == (6, 8)  # 3 pages each: 3 per rank of 10 vs 4 per rank of 12
    for eng in (dp, dop):
        assert eng.scheduler.book_errors() == []
    long = list(range(44))  # 11 pages: more than a DP rank's 10, on one DOP owner's 12
    with pytest.raises(ValueError, match="can never run"):
        decode("dp").new_request("long", params=SamplingParams(max_tokens=4), prompt_token_ids=long)
    eng = decode("dop")
    req = eng.new_request("long", params=SamplingParams(max_tokens=4), prompt_token_ids=long)
    assert eng.scheduler.reserve(req.seqs[0]) and sorted(eng.allocator.num_free) == [1, 12]
