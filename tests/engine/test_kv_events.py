"""KV-cache events: the bundled model's engine publishes over a real ZeroMQ socket what its prefix cache holds, in
vLLM's wire format. A subscriber that applies the events ends up with exactly the engine's cached block hashes,
after prompts, after evictions in a small cache, and through the replay socket."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from fulcrum.engine.kv_event_publisher import KVEventsConfig
from fulcrum.engine.llm import LLM
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.hashing import hash_prefix_blocks
from fulcrum.utils.kv_event_schema import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decoder
from fulcrum.utils.serve_process import free_port

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class Subscriber:
    """Applies events as a consumer would: block hash -> present, in sequence order."""

    def __init__(self, endpoint: str, topic: str = ""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.decode = decoder()
        self.held: set[int] = set()
        self.seqs: list[int] = []
        self.events: list = []
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription reaches it

    def apply(self, batch) -> None:
        for ev in batch.events:
            self.events.append(ev)
            if isinstance(ev, BlockStored):
                self.held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.held.clear()

    def drain(self, quiet_ms: int = 300) -> None:
        while self.sock.poll(quiet_ms):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.apply(self.decode.decode(payload))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _engine(num_tokens: int, **events) -> tuple[LLM, str]:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, **events}
    # the bundled model in fp32 keeps 8 KiB per token: 16-token blocks, `num_tokens` of them in all
    llm = LLM(kv_cache_memory=num_tokens * 8192, max_model_len=128, kv_events_config=cfg)
    return llm, endpoint


@pytest.fixture(scope="module")
def small_engine():
    llm, endpoint = _engine(16 * 16, replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv")
    yield llm, endpoint
    llm.core.shutdown()


def test_events_mirror_the_cache_after_prompts_and_evictions(small_engine):
    llm, endpoint = small_engine
    kv = llm.core.kv
    sub = Subscriber(endpoint, "kv")
    try:
        prompt = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east. " * 2
        ids = llm.generate([prompt], GREEDY)[0].prompt_token_ids
        sub.drain()
        blocks = hash_prefix_blocks(ids, kv.block_size)
        assert set(blocks) <= sub.held  # the prompt's full blocks, under the engine's own chained hash
        assert sub.held == set(kv.cached)
        stored = [e for e in sub.events if isinstance(e, BlockStored)]
        first = stored[0]
        assert first.parent_block_hash is None and first.block_size == kv.block_size
        assert first.token_ids == ids[: len(first.block_hashes) * kv.block_size]
        assert first.medium == "CPU"
        # the cache holds 16 blocks: distinct prompts push the first one's blocks out
        for i in range(8):
            llm.generate([f"{i} KING HENRY: Once more unto the breach, dear friends, once more {i}. " * 2], GREEDY)
        sub.drain()
        removed = {h for e in sub.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert set(blocks) & removed, "the small cache evicted nothing"
        assert sub.held == set(kv.cached)
        assert not set(blocks) <= sub.held
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # one batch per step, in order
    finally:
        sub.close()


def test_replay_returns_the_buffered_batches_from_a_sequence(small_engine):
    llm, _ = small_engine
    cfg = llm.core.kv_events.cfg
    llm.generate(["MERCUTIO: A plague o' both your houses! They have made worms' meat of me."], GREEDY)
    time.sleep(0.2)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(cfg.replay_endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = Subscriber.__new__(Subscriber)
    replayed.held, replayed.events, seqs = set(), [], []
    dec = decoder()
    try:
        while sock.poll(2000):
            _, topic, seq, payload = sock.recv_multipart()  # the live stream's frames, after the envelope
            if seq == END_SEQ:
                assert payload == b"" and topic == b""
                break
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            replayed.apply(dec.decode(payload))
        else:
            pytest.fail("the replay never ended")
    finally:
        sock.close(0)
        ctx.term()
    assert seqs[0] == 0 and seqs == list(range(len(seqs)))
    assert isinstance(replayed.events[0], AllBlocksCleared)  # a (re)started publisher says so first
    assert replayed.held == set(llm.core.kv.cached)  # the whole history rebuilds the cache's state


class VllmBlockStored(msgspec.Struct, tag="BlockStored"):
    """A consumer of vLLM 0.32's events: maps tagged by "type", newer optional fields we never set."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    locality: str | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    ownership: str | None = None


class VllmCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmCleared]
    data_parallel_rank: int | None = None


def test_the_payload_decodes_as_vllm_reads_it_and_older_vllm_payloads_decode_here():
    from fulcrum.utils.kv_event_schema import EventBatch

    stored = BlockStored([2**64 - 5, 8], None, list(range(32)), 16, None, "GPU", None)
    raw = msgspec.msgpack.encode(EventBatch(1.5, [AllBlocksCleared(), stored, BlockRemoved([8], "GPU")]))
    got = msgspec.msgpack.decode(raw, type=VllmBatch)
    assert isinstance(got.events[0], VllmCleared)
    assert got.events[1].block_hashes == [2**64 - 5, 8] and got.events[1].block_size == 16
    assert got.events[1].medium == "GPU" and got.events[2].block_hashes == [8]
    # an older vLLM's batch: events as arrays in field order, tag first, without medium
    old = msgspec.msgpack.encode([2.0, [["BlockStored", [1, 2], None, list(range(32)), 16, None], ["BlockRemoved", [1]],
                                        ["AllBlocksCleared"]]])  # fmt: skip
    batch = decoder().decode(old)
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0].block_hashes == [1, 2] and batch.events[1].block_hashes == [1]
    with pytest.raises(msgspec.DecodeError):
        decoder().decode(b"\xc1")


def test_config_is_checked():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse({"enable_kv_cache_events": False}) is None
    assert KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}) is None
    cfg = KVEventsConfig.parse({"enable_kv_cache_events": True})
    assert cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557" and cfg.buffer_steps == 10_000
    with pytest.raises(InvalidRequestError, match="unknown key.*enpoint"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "enpoint": "tcp://*:1"})
    with pytest.raises(InvalidRequestError, match="publisher"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})


def test_serve_refuses_a_bad_config_before_loading():
    out = subprocess.run(
        [sys.executable, "-m", "fulcrum.cli", "serve", "--kv-events-config", '{"enable_kv_cache_events": 1, "x": 2}'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "unknown key(s) x" in out.stderr


def test_a_taken_endpoint_fails_the_engine_start_with_its_name(small_engine):
    _, endpoint = small_engine
    with pytest.raises(InvalidRequestError, match="cannot bind tcp://127.0.0.1"):
        _engine(16 * 16, endpoint=endpoint)


def test_data_parallel_ranks_publish_on_their_own_ports():
    from fulcrum.config import EngineConfig
    from fulcrum.engine.core_client import data_parallel_configs

    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6557"}
    ranks = data_parallel_configs(EngineConfig(data_parallel_size=2, kv_events_config=cfg, cpu_bind="none"))
    assert [c.kv_events_config["endpoint"] for c in ranks] == ["tcp://*:5557", "tcp://*:5558"]
    assert [c.kv_events_config["replay_endpoint"] for c in ranks] == ["tcp://*:6557", "tcp://*:6558"]
    assert cfg["endpoint"] == "tcp://*:5557"  # the caller's dict is left alone
