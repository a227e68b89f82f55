"""Policies, the pool's load and the metric scrape on fakes: no replicas started."""

from __future__ import annotations

import time

from fulcrum.router.policies import LeastLoad, Prefix, RoundRobin, Weighted
from fulcrum.router.pool import SATURATED, Pool
from fulcrum.router.scrape import parse_metrics
from fulcrum.utils.hashing import hash_prefix_blocks

FULCRUM_METRICS = """\
# TYPE fulcrum:num_requests_waiting gauge
fulcrum:num_requests_waiting{model_name="m"} 3.0
# TYPE fulcrum:num_requests_running gauge
fulcrum:num_requests_running{model_name="m"} 2.0
# TYPE fulcrum:kv_cache_usage_perc gauge
fulcrum:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE fulcrum:cache_config_info gauge
fulcrum:cache_config_info{block_size="32",cache_dtype="auto",model_name="m",num_blocks="512"} 1.0
# TYPE fulcrum:time_to_first_token_seconds histogram
fulcrum:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5.0
fulcrum:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 9.0
fulcrum:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
fulcrum:time_to_first_token_seconds_count{model_name="m"} 10.0
fulcrum:time_to_first_token_seconds_sum{model_name="m"} 3.0
"""

VLLM_METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
"""


def test_parse_fulcrum_and_vllm_names():
    m = parse_metrics(FULCRUM_METRICS)
    assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_blocks) == (3, 2, 0.25, 32, 512)
    assert m.ttft.count == 10 and m.ttft.quantile(0.5) == 0.1
    assert 0.1 < m.ttft.quantile(0.9) <= 1.0
    v = parse_metrics(VLLM_METRICS)
    assert (v.waiting, v.kv_usage, v.block_size, v.num_blocks) == (7, 0.5, 16, 100)


def pool_of(n, **loads):
    pool = Pool([f"http://r{i}" for i in range(n)])
    for r in pool.replicas.values():
        r.healthy, r.scraped_at = True, time.monotonic()
        r.metrics.block_size = 4
    return pool, list(pool.replicas.values())


def hashes_of(tokens):
    return lambda bs: hash_prefix_blocks(tokens, bs)


def test_round_robin_cycles_and_least_load_picks_the_lightest():
    pool, (a, b, c) = pool_of(3)
    rr = RoundRobin(pool)
    assert [rr.choose([a, b, c], None).replica for _ in range(4)] == [a, b, c, a]
    a.in_flight, b.metrics.waiting, c.in_flight = 2, 1, 3
    assert LeastLoad(pool).choose([a, b, c], None).replica is b


def test_a_stale_scrape_counts_as_saturated():
    pool, (a, b) = pool_of(2)
    a.scraped_at -= 10
    assert a.load(pool.stale_after) == SATURATED
    b.in_flight = 50
    assert LeastLoad(pool).choose([a, b], None).replica is b


def test_prefix_longest_match_wins_and_the_guard_overrides():
    pool, (a, b) = pool_of(2)
    shared = list(range(40))
    a.remember(hash_prefix_blocks(shared[:20], 4))
    b.remember(hash_prefix_blocks(shared[:8], 4))
    policy = Prefix(pool, balance_margin=2)
    d = policy.choose([a, b], hashes_of(shared + [99, 98]))
    assert (d.replica, d.reason, d.cached_blocks, d.prompt_blocks) == (a, "prefix", 5, 10)
    a.in_flight = 2  # 2 - 0 is not more than the margin
    assert policy.choose([a, b], hashes_of(shared)).reason == "prefix"
    a.in_flight = 3
    d = policy.choose([a, b], hashes_of(shared))
    assert (d.replica, d.reason) == (b, "load-guard")
    # nothing cached anywhere: the least loaded
    assert policy.choose([a, b], hashes_of([7] * 12)).reason == "no-prefix"


def test_prefix_ties_are_broken_at_random():
    pool, (a, b) = pool_of(2)
    tokens = list(range(16))
    for r in (a, b):
        r.remember(hash_prefix_blocks(tokens, 4))
    picks = {Prefix(pool).choose([a, b], hashes_of(tokens)).replica.url for _ in range(50)}
    assert picks == {a.url, b.url}


def test_weighted_trades_prefix_for_load():
    pool, (a, b) = pool_of(2)
    tokens = list(range(16))
    a.remember(hash_prefix_blocks(tokens, 4))
    w = Weighted(pool, prefix_weight=1.0, load_weight=0.2)
    assert w.choose([a, b], hashes_of(tokens)).replica is a
    a.in_flight = 6  # 1.0 - 1.2 < 0
    assert w.choose([a, b], hashes_of(tokens)).replica is b


def test_remembered_blocks_are_bounded_by_the_replica_cache():
    pool, (a,) = pool_of(1)
    a.metrics.num_blocks = 3
    a.remember([1, 2, 3, 4, 5])
    assert list(a.blocks) == [3, 4, 5]


def test_kv_events_and_weighted_read_the_index_at_its_block_size():
    from fulcrum.router.kv_index import KVIndex
    from fulcrum.router.policies import KVEvents
    from fulcrum.utils.kv_event_schema import BlockStored, EventBatch

    pool, (a, b) = pool_of(2)
    tokens = list(range(40))
    a.remember(hash_prefix_blocks(tokens, 4))  # what prefix would guess: ignored by the index-based policies
    index = KVIndex()
    blocks = hash_prefix_blocks(tokens, 8)  # the replica's events say 8-token blocks (its scrape said 4)
    index.apply(b.url, 0, EventBatch(0.0, [BlockStored(blocks[:3], None, tokens[:24], 8, None, "CPU", None)]))
    d = KVEvents(pool, index, balance_margin=2).choose([a, b], hashes_of(tokens))
    assert (d.replica, d.reason, d.cached_blocks, d.prompt_blocks) == (b, "kv-events", 3, 5)
    b.in_flight = 3
    assert KVEvents(pool, index, balance_margin=2).choose([a, b], hashes_of(tokens)).reason == "load-guard"
    w = Weighted(pool, prefix_weight=1.0, load_weight=0.1, index=index)
    b.in_flight = 5  # 3/5 - 0.5 > 0 - 0
    assert w.choose([a, b], hashes_of(tokens)).replica is b
    b.in_flight = 7  # 0.6 - 0.7 < 0
    assert w.choose([a, b], hashes_of(tokens)).replica is a
