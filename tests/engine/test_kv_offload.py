"""The KV offload tiers below the pool (engine/kv_offload), on engine cores in this process with a pool too small
for the prompts: a prefix evicted from the pool comes back from host memory or disk with the tokens a cold run
gives, survives a restart on the same directory, is never taken from another model's or layout's blocks, and a
corrupt, truncated, deleted or unwritable block file costs a recompute (with a log line), never a failed request."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import pytest

from fulcrum.config import EngineConfig
from fulcrum.engine.core import EngineCore
from fulcrum.engine.kv_offload import tiers
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import SamplingParams
from tests.engine.stepping import run_request

GREEDY = SamplingParams(max_tokens=8, temperature=0)
BS = 16
# four prompts of 7 full blocks; a pool of 16 blocks holds two of them, so the first is evicted by the last
PROMPTS = [[(37 * i + 11 * k) % 60 + 3 for k in range(7 * BS + 5)] for i in range(4)]
SMALL_POOL = dict(kv_cache_memory=2 << 20, max_model_len=256, cpu_threads=1, cpu_bind="none")


def make_core(model=None, **kw) -> EngineCore:
    cfg = {**SMALL_POOL, **kw}
    if model is not None:
        cfg["model"] = model
        cfg["kv_cache_memory"] = kw.get("kv_cache_memory", 1 << 20)
    return EngineCore(EngineConfig(**cfg))


def run(core: EngineCore, rid: str, ids, sp=GREEDY):
    """Step the core until `rid` ends: (its tokens, its last output), which must end at its length."""
    toks, last = run_request(core, rid, ids, sp)
    assert last is not None and last.finish_reason == "length", last
    return toks, last


def run_all(core, tag: str):
    return [run(core, f"{tag}-{i}", p) for i, p in enumerate(PROMPTS)]


def counts(core) -> dict:
    return core.stats().kv_offload


def block_files(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/*/*{tiers.SUFFIX}"))


@pytest.fixture(scope="module")
def cold():
    """Each prompt's tokens from an engine without prefix caching."""
    core = make_core(enable_prefix_caching=False)
    try:
        yield [run(core, f"cold-{i}", p)[0] for i, p in enumerate(PROMPTS)]
    finally:
        core.shutdown()


def test_host_memory_hit_equals_cold_and_counts_as_cached(cold):
    core = make_core(kv_offloading_size=0.05)
    try:
        assert core.kv.num_blocks < 2 * len(PROMPTS[0]) // BS + 4  # the pool cannot keep the first prompt
        run_all(core, "a")
        toks, out = run(core, "again", PROMPTS[0])
        assert toks == cold[0]
        assert out.num_cached_tokens == 7 * BS  # every full block of the prompt, from host memory
        c = counts(core)
        assert c["ram_hit_blocks"] == 7 and c["ram_hit_tokens"] == 7 * BS and c["ram_stored_blocks"] >= 4 * 7
        assert 0 < c["ram_used_bytes"] <= c["ram_capacity_bytes"]
        lat = core.stats().kv_offload_latency
        assert sum(lat["load:ram"][:-1]) == 1 and sum(lat["store:ram"][:-1]) >= 1
        assert core.stats().prefix_cache_hits >= 7 * BS
    finally:
        core.shutdown()


def test_disk_tier_hit_and_warm_restart(cold, tmp_path):
    """Disk only: an evicted prefix comes back from its files; a new engine on the same directory starts warm."""
    core = make_core(kv_offload_dir=str(tmp_path))
    try:
        run_all(core, "a")
        toks, out = run(core, "again", PROMPTS[0])
        assert toks == cold[0] and out.num_cached_tokens == 7 * BS
        assert counts(core)["disk_hit_blocks"] == 7
    finally:
        core.shutdown()
    assert len(block_files(tmp_path)) >= 4 * 7
    restarted = make_core(kv_offload_dir=str(tmp_path))
    try:
        for i in (3, 1):
            toks, out = run(restarted, f"warm-{i}", PROMPTS[i])
            assert toks == cold[i] and out.num_cached_tokens == 7 * BS
        assert counts(restarted)["disk_hit_blocks"] == 14
        assert counts(restarted)["disk_stored_blocks"] == 0  # already there: nothing written twice
    finally:
        restarted.shutdown()


def test_other_layouts_on_the_same_directory_load_nothing(cold, tmp_path, caplog, tiny_model_dir):
    first = make_core(kv_offload_dir=str(tmp_path))
    try:
        run_all(first, "a")
    finally:
        first.shutdown()
    others = [
        dict(block_size=32),
        dict(kv_cache_dtype="int8"),
        dict(model=str(tiny_model_dir("llama"))),
    ]
    for kw in others:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fulcrum.engine.kv_offload"):
            core = make_core(kv_offload_dir=str(tmp_path), **kw)
        try:
            assert "belong to another model or layout and are ignored" in caplog.text, kw
            ids = PROMPTS[0] if "model" not in kw else [t % 50 + 1 for t in PROMPTS[0]]
            _, out = run(core, "other", ids)
            assert out.num_cached_tokens == 0 and counts(core)["disk_hit_blocks"] == 0, kw
        finally:
            core.shutdown()


def _warm_dir(tmp_path) -> None:
    core = make_core(kv_offload_dir=str(tmp_path))
    try:
        run(core, "w", PROMPTS[0])
    finally:
        core.shutdown()


def _block_file(tmp_path, core, position: int) -> Path:
    """The file of the prompt's block at `position`, by the engine's own hash chain."""
    from fulcrum.utils.hashing import hash_prefix_blocks

    h = hash_prefix_blocks(PROMPTS[0], BS)[position]
    return core.kv_offload.disk.path(h)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_block_file_is_dropped_and_recomputed(cold, tmp_path, caplog, damage, monkeypatch):
    """A byte changed on disk, a file cut short or one deleted between lookup and read: the prefix before it
    loads, the rest is recomputed, the tokens are a cold run's, and the request succeeds."""
    _warm_dir(tmp_path)
    core = make_core(kv_offload_dir=str(tmp_path))
    try:
        path = _block_file(tmp_path, core, 4)
        if damage == "delete":  # after the lookup found it: the lookup is made to believe it is still there
            path.unlink()
            gone = int(path.stem, 16)
            found = tiers.DiskTier.__contains__
            monkeypatch.setattr(tiers.DiskTier, "__contains__", lambda self, h: h == gone or found(self, h))
        else:
            data = bytearray(path.read_bytes())
            if damage == "flip":
                data[-100] ^= 0x40
            else:
                data = data[: len(data) // 2]
            path.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="fulcrum.engine.kv_offload"):
            toks, out = run(core, "r", PROMPTS[0])
        assert toks == cold[0]
        assert out.num_cached_tokens == 4 * BS  # the four blocks before the damaged one
        assert "the rest of its prefix is recomputed" in caplog.text
        assert not path.exists() or damage == "delete" and path.exists()  # dropped (or rewritten by the recompute)
        c = counts(core)
        assert c["disk_corrupt_blocks" if damage != "delete" else "disk_errors"] == 1
    finally:
        core.shutdown()


def test_a_full_disk_degrades_to_recompute(cold, tmp_path, caplog, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    core = make_core(kv_offload_dir=str(tmp_path))
    monkeypatch.setattr(tiers.DiskTier, "_atomic_write", staticmethod(full))
    try:
        with caplog.at_level(logging.WARNING, logger="fulcrum.engine.kv_offload"):
            got = run_all(core, "a")
            toks, _ = run(core, "again", PROMPTS[0])
            core.kv_offload.close()  # the writer has tried every block
        assert [t for t, _ in got] == cold and toks == cold[0]
        assert caplog.text.count("No space left on device") == 1  # one line, not one per block
        assert counts(core)["disk_errors"] >= 1 and counts(core)["disk_stored_blocks"] == 0
    finally:
        core.shutdown()


def test_a_directory_that_cannot_be_written_serves_without_a_disk_tier(cold, caplog):
    with caplog.at_level(logging.WARNING, logger="fulcrum.engine.kv_offload"):
        core = make_core(kv_offload_dir="/proc/fulcrum-kv-offload")
    try:
        assert "is not writable" in caplog.text
        got = run_all(core, "a")
        assert [t for t, _ in got] == cold
    finally:
        core.shutdown()


def test_quantized_kv_cache_comes_back_from_both_tiers(tmp_path):
    """An int8 cache's blocks carry their scales: tokens after a host-memory and after a disk hit equal the int8
    engine's own cold run."""
    ref = make_core(kv_cache_dtype="int8", enable_prefix_caching=False)
    try:
        want = run(ref, "ref", PROMPTS[0])[0]
    finally:
        ref.shutdown()
    for kw in (dict(kv_offloading_size=0.05), dict(kv_offload_dir=str(tmp_path))):
        core = make_core(kv_cache_dtype="int8", **kw)
        try:
            run_all(core, "a")
            toks, out = run(core, "again", PROMPTS[0])
            assert toks == want and out.num_cached_tokens == 7 * BS, kw
        finally:
            core.shutdown()


def test_mla_cache_comes_back(tiny_model_dir, tmp_path):
    """Multi-head latent attention keeps one latent per token: its blocks go through the tiers the same way."""
    model = str(tiny_model_dir("deepseek-v2"))
    ids = [[t % 50 + 1 for t in p] for p in PROMPTS]
    ref = make_core(model, enable_prefix_caching=False, kv_cache_memory=88 << 10)
    try:
        want = run(ref, "ref", ids[0])[0]
    finally:
        ref.shutdown()
    core = make_core(model, kv_offload_dir=str(tmp_path), kv_cache_memory=88 << 10)
    try:
        assert core.kv.num_blocks * BS < 2 * len(ids[0]) + 64
        for i, p in enumerate(ids):
            run(core, f"a-{i}", p)
        toks, out = run(core, "again", ids[0])
        assert toks == want and out.num_cached_tokens == 7 * BS
    finally:
        core.shutdown()


def test_abort_while_reading_frees_everything(tmp_path):
    _warm_dir(tmp_path)
    core = make_core(kv_offload_dir=str(tmp_path))
    try:
        core.add_request("r", list(PROMPTS[0]), GREEDY)
        assert core.kv_offload.busy() or core.scheduler.waiting  # waits for its reads (or they were quick)
        outs = core.abort_requests(["r"])
        assert [o.finish_reason for o in outs] == ["abort"]
        deadline = time.time() + 5
        while core.has_unfinished_requests() and time.time() < deadline:
            core.step()
        s = core.stats()
        assert s.num_free_blocks == s.num_blocks and not core.kv_offload.staged and not core.kv.req_hashes
    finally:
        core.shutdown()


def test_block_files_are_evicted_least_recently_used_first(tmp_path):
    import torch

    shapes, dtypes = [(2, 4)], [torch.float32]
    disk = tiers.DiskTier(tmp_path, capacity=5 * (tiers.HEADER.size + 32), layout={"m": 1}, shapes=shapes,
                          dtypes=dtypes)  # fmt: skip
    blocks = {h: (torch.full((2, 4), float(h)),) for h in range(1, 7)}
    for h in range(1, 6):
        assert disk.put(h, blocks[h])
        time.sleep(0.01)
    assert torch.equal(disk.get(1)[0], blocks[1][0])  # touched: now the most recent
    assert not disk.put(1, blocks[1])  # there already
    disk.put(6, blocks[6])  # over the cap: the oldest go until under 90%
    assert 1 in disk and 6 in disk and 2 not in disk
    assert disk.used <= disk.capacity
    # another replica's temporary file is never a block; a stale one is cleared at the next start
    tmp = disk.path(9).with_name(disk.path(9).name + ".tmp.1.ab")
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"partial")
    assert 9 not in disk


def test_offload_refuses_what_it_cannot_serve():
    with pytest.raises(InvalidRequestError, match="prefix caching"):
        EngineConfig(kv_offload_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(InvalidRequestError, match="tensor or pipeline"):
        EngineConfig(kv_offloading_size=1.0, tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=-1.0)


def test_a_decode_engine_finds_the_prefix_in_its_tiers_and_pulls_nothing(cold, tmp_path):
    """P/D: a consumer whose disk tier holds the prompt's blocks loads them itself; the producer's lease ends."""
    pair = {"secret": "the pair's own"}
    producer = make_core(kv_cache_memory=40 << 20, max_model_len=None,
                         kv_transfer_config={"kv_role": "kv_producer", **pair})  # fmt: skip
    consumer = make_core(kv_offload_dir=str(tmp_path), kv_transfer_config={"kv_role": "kv_consumer", **pair})
    try:
        run_all(consumer, "a")  # the first prompt's blocks: on disk, gone from the pool
        producer.add_request("p", list(PROMPTS[0]), SamplingParams(max_tokens=1, temperature=0),
                             kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        params = None
        while producer.has_unfinished_requests():
            for o in producer.step():
                params = o.kv_transfer_params or params
        assert params and params["do_remote_prefill"]
        consumer.add_request("d", list(PROMPTS[0]), GREEDY, kv_transfer_params=params)
        toks, out = [], None
        while consumer.has_unfinished_requests():
            for o in consumer.step():
                toks += o.new_token_ids
                out = o
        assert toks == cold[0] and out.num_cached_tokens == 7 * BS
        s = consumer.stats()
        assert s.kv_transfer_blocks_received == 0 and s.kv_offload["disk_hit_blocks"] == 7
        deadline = time.time() + 5
        while producer.stats().kv_transfer_held_blocks and time.time() < deadline:
            producer.housekeeping()
            time.sleep(0.05)
        assert producer.stats().kv_transfer_held_blocks == 0  # released now, not at its lease's timeout
    finally:
        for core in (producer, consumer):
            core.shutdown()


@pytest.mark.parametrize("mode", ["batched_copies", "async_scheduling"])
def test_gpu_style_copies_and_async_scheduling_give_the_same_tokens(cold, mode):
    """The gather/scatter copies a GPU engine makes (run here on the host's tensors), and an engine that schedules
    each step before the last is read back: a host-memory hit still gives a cold run's tokens."""
    core = make_core(kv_offloading_size=0.05, async_scheduling=mode == "async_scheduling")
    try:
        core.kv_offload.batched_copies = mode == "batched_copies"
        got = run_all(core, "a")
        toks, out = run(core, "again", PROMPTS[0])
        assert [t for t, _ in got] == cold and toks == cold[0] and out.num_cached_tokens == 7 * BS
        assert counts(core)["ram_hit_blocks"] == 7
    finally:
        core.shutdown()


def test_a_preempted_request_resumes_from_host_memory(cold):
    """Preemption frees a running request's blocks, output blocks too; they go to host memory, and its readmission
    copies them back instead of recomputing them."""
    core = make_core(kv_offloading_size=0.05, max_num_seqs=4)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    try:
        ids = {f"p{i}": p for i, p in enumerate(PROMPTS)}
        for rid, p in ids.items():
            core.add_request(rid, list(p), sp)
        toks = {rid: [] for rid in ids}
        while core.has_unfinished_requests():
            for o in core.step():
                toks[o.request_id] += o.new_token_ids
        assert core.scheduler.num_preemptions > 0
        assert counts(core)["ram_hit_blocks"] > 0
        ref = make_core(enable_prefix_caching=False, max_num_seqs=1)
        try:
            for rid, p in ids.items():
                assert toks[rid] == run(ref, rid, p, sp)[0], rid
        finally:
            ref.shutdown()
    finally:
        core.shutdown()


def test_tier_stats_add_up_across_data_parallel_cores_and_reach_prometheus():
    from prometheus_client import generate_latest

    from fulcrum.engine.core_client import total_stats
    from fulcrum.engine.kv_offload.offload import LATENCY_BUCKETS
    from fulcrum.engine.messages import CoreOutputs, SchedulerStats
    from fulcrum.server.metrics import ServerMetrics

    n = len(LATENCY_BUCKETS) + 1
    a = SchedulerStats(num_blocks=4, kv_offload={"ram_hit_tokens": 32, "disk_used_bytes": 100},
                       kv_offload_latency={"load:ram": [1] + [0] * (n - 1) + [300]})  # fmt: skip
    b = SchedulerStats(num_blocks=4, kv_offload={"ram_hit_tokens": 16},
                       kv_offload_latency={"load:ram": [0, 2] + [0] * (n - 2) + [2000]})  # fmt: skip
    total = total_stats([a, b])
    assert total.kv_offload == {"ram_hit_tokens": 48, "disk_used_bytes": 100}
    assert total.kv_offload_latency["load:ram"][:2] == [1, 2] and total.kv_offload_latency["load:ram"][-1] == 2300
    metrics = ServerMetrics("m")
    metrics.record(CoreOutputs([], total), 0.0)
    text = generate_latest(metrics.registry).decode()
    assert 'fulcrum:kv_offload_hit_tokens_total{model_name="m",tier="ram"} 48.0' in text
    assert 'fulcrum:kv_offload_used_bytes{model_name="m",tier="disk"} 100.0' in text
    assert f'fulcrum:kv_offload_load_seconds_bucket{{le="{LATENCY_BUCKETS[1]}",model_name="m",tier="ram"}} 3.0' in text
    assert 'fulcrum:kv_offload_load_seconds_count{model_name="m",tier="ram"} 3.0' in text
    assert 'fulcrum:kv_offload_load_seconds_sum{model_name="m",tier="ram"} 0.0023' in text
    assert "kv_offload" not in generate_latest(ServerMetrics("idle").registry).decode()  # no tiers, no series


def test_a_cap_over_the_free_space_shrinks_to_it(tmp_path, caplog, monkeypatch):
    from fulcrum.engine.kv_offload import offload

    monkeypatch.setattr(offload, "free_bytes", lambda path: 10 << 20)
    with caplog.at_level(logging.WARNING, logger="fulcrum.engine.kv_offload"):
        core = make_core(kv_offload_dir=str(tmp_path), kv_offload_dir_size=4.0)
    try:
        assert "has 0.0 GiB free, under the disk tier's cap of 4.0 GiB" in caplog.text
        assert core.kv_offload.disk.capacity == int(0.9 * (10 << 20))
    finally:
        core.shutdown()
