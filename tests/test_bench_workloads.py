"""The prefix-sharing workloads of `splash bench serve` (grpo, multiturn) and the cache counters read from
either server's /metrics."""

from __future__ import annotations

import pytest

from splash.bench.workloads import cache_counters, conversations


def test_grpo_groups_share_one_prompt():
    convs = conversations("grpo", 24, 10, 50, seed=1, group_size=8)
    assert len(convs) == 24 and all(len(c) == 1 for c in convs)
    groups = [convs[i:i + 8] for i in range(0, 24, 8)]
    assert all(all(c[0] == g[0][0] for c in g) for g in groups)  # 8 samples, one prompt, consecutive
    assert len({tuple(g[0][0]) for g in groups}) == 3 and all(len(c[0]) == 10 for c in convs)


def test_multiturn_resends_the_history():
    convs = conversations("multiturn", 12, 20, 50, seed=2, turns=3, turn_len=5)
    assert len(convs) == 4 and all(len(c) == 3 for c in convs)
    for c in convs:
        assert [len(p) for p in c] == [20, 25, 30]
        assert c[1][:20] == c[0] and c[2][:25] == c[1]


def test_bad_workload_input():
    for kw, msg in (({"group_size": 0}, "group-size"),):
        with pytest.raises(ValueError, match=msg):
            conversations("grpo", 8, 4, 10, 0, **kw)
    with pytest.raises(ValueError, match="turns"):
        conversations("multiturn", 8, 4, 10, 0, turns=0)
    with pytest.raises(ValueError, match="unknown workload"):
        conversations("chat", 8, 4, 10, 0)


def test_cache_counters_read_both_servers_names():
    splash = ('# TYPE splash:prefix_cache_queries counter\n'
              'splash:prefix_cache_queries_total{model_name="m"} 150\n'
              '# TYPE splash:prefix_cache_hits counter\nsplash:prefix_cache_hits_total{model_name="m"} 96\n'
              '# TYPE splash:kv_cache_usage_perc gauge\nsplash:kv_cache_usage_perc{model_name="m"} 0.25\n')
    vllm = ('# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine="0"} 10\n'
            '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0"} 4\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n')
    assert cache_counters(splash) == {"prefix_cache_queries": 150, "prefix_cache_hits": 96, "kv_usage": 0.25}
    assert cache_counters(vllm) == {"prefix_cache_queries": 10, "prefix_cache_hits": 4, "kv_usage": 0.5}
