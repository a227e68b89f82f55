"""The shared-memory and torch.distributed (gloo here, NCCL on CUDA) KV connectors between two engine cores in this
process: greedy output through a producer and a consumer equals one engine's, every block and every /dev/shm
segment comes back (finished, aborted, unpulled and killed-consumer transfers, a closed producer), pairs end, and
the handshake refuses a pair whose data paths cannot meet."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq

from fulcrum.config import DEFAULT_MODEL, EngineConfig
from fulcrum.engine.core import EngineCore
from fulcrum.engine.kv_transfer import KVTransferConfig, KVTransferError, check_remote_prefill
from fulcrum.engine.kv_transfer.shm_connector import (
    SharedMemoryConnector,
    live_segments,
    own_prefix,
    sweep_dead_segments,
)
from fulcrum.utils.tokenizer import load_tokenizer
from tests.engine.test_kv_transfer import GREEDY, PREFILL, TEXT, TRUST, all_free, make_core, run, settle

CONNECTORS = ["SharedMemoryConnector", "TorchDistributedConnector"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def plain():
    core = EngineCore(EngineConfig(kv_cache_memory=40 << 20, cpu_threads=1, cpu_bind="none"))
    yield core
    core.shutdown()


@pytest.fixture(scope="module", params=CONNECTORS)
def pair(request):
    name = request.param
    made = {
        "name": name,
        "prefill": make_core("producer", kv_connector=name, lease_timeout_s=1.0, pull_timeout_s=1.0),
        "decode": make_core("kv_consumer", kv_connector=name, pull_timeout_s=1.0),
    }
    yield made
    made["decode"].shutdown()
    conn = made["prefill"].kv_transfer.connector
    if name == "TorchDistributedConnector":  # the consumer's close said unpair: the producer's group goes
        deadline = time.time() + 3
        while conn._out and time.time() < deadline:
            time.sleep(0.05)
        assert conn._out == {}
    made["prefill"].shutdown()
    assert live_segments() == []


def prefill(pair, rid, ids):
    toks, out = run(pair["prefill"], rid, ids, PREFILL, {"do_remote_decode": True})
    assert out.finish_reason == "length" and len(toks) == 1
    return out.kv_transfer_params


def ask(host: str, port: int, kind: bytes, head: dict) -> tuple[bytes, dict]:
    """One control message to a producer, as a consumer that then vanishes (no release): its answer."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.connect(f"tcp://{host}:{port}")
        s.send_multipart([kind, msgspec.msgpack.encode(head)])
        assert s.poll(5000)
        kind, info = s.recv_multipart()
        return kind, msgspec.msgpack.decode(info)
    finally:
        ctx.destroy(linger=0)


def pooled(core) -> list[str]:
    """The producer's released segments, kept for reuse (any other left in /dev/shm is a leak)."""
    conn = core.kv_transfer.connector
    return conn.pooled() if isinstance(conn, SharedMemoryConnector) else []


def settled(pair) -> bool:
    settle(pair["prefill"], until=lambda: all_free(pair["prefill"]))
    clean = live_segments() == pooled(pair["prefill"])
    return all_free(pair["prefill"]) and all_free(pair["decode"]) and clean


def test_prefill_then_decode_equals_one_engine(pair, plain, tok):
    ids = tok(TEXT)["input_ids"]
    ref, _ = run(plain, "ref", ids)
    params = prefill(pair, "p-1", ids)
    want = {"SharedMemoryConnector": "shm", "TorchDistributedConnector": "torch.distributed"}[pair["name"]]
    assert params["kv_transport"] == want
    d = pair["decode"]
    before = d.stats()
    toks, out = run(d, "d-1", ids, params=params)
    assert toks == ref and out.finish_reason == "length"
    # a second prompt: its pull reuses the pair's process group (torch.distributed)
    ids2 = tok("JULIET: " + TEXT[: len(TEXT) // 2])["input_ids"]  # no shared prefix, fewer blocks
    ref2, _ = run(plain, "ref-1b", ids2)
    params2 = prefill(pair, "p-1b", ids2)
    toks, _ = run(d, "d-1b", ids2, params=params2)
    assert toks == ref2
    after = d.stats()
    moved = len(params["remote_block_ids"]) + len(params2["remote_block_ids"])
    assert after.kv_transfer_blocks_received - before.kv_transfer_blocks_received == moved
    assert after.kv_transfer_fallbacks == before.kv_transfer_fallbacks
    assert after.kv_transfer_bytes_received - before.kv_transfer_bytes_received == moved * (
        pair["prefill"].kv_transfer.connector.block_nbytes()
    )
    via = {"SharedMemoryConnector": "shm", "TorchDistributedConnector": "p2p"}[pair["name"]]
    assert d.kv_transfer.connector.stats.pulls_via.get(via, 0) >= 2  # the blocks took this connector's path
    assert after.kv_transfer_inline_pulls == 0
    if pair["name"] == "SharedMemoryConnector":  # the first pull's segment, released, served the second
        assert len(pooled(pair["prefill"])) == 1
    if pair["name"] == "TorchDistributedConnector":
        assert len(d.kv_transfer.connector._in) == 1 and len(pair["prefill"].kv_transfer.connector._out) == 1
    assert settled(pair)


def test_abort_while_waiting_frees_blocks_and_segments(pair, tok):
    ids = tok(TEXT + " TYBALT: What, drawn, and talk of peace!")["input_ids"]
    params = prefill(pair, "p-2", ids)
    d = pair["decode"]
    d.add_request("d-2", ids, GREEDY, kv_transfer_params=params)
    assert [o.finish_reason for o in d.abort_requests(["d-2"])] == ["abort"]
    settle(d, pair["prefill"], until=lambda: all_free(d) and all_free(pair["prefill"]))
    assert settled(pair)


def test_unpulled_lease_expires_and_frees(pair, tok):
    ids = tok("KING LEAR: Blow, winds, and crack your cheeks! rage! blow! You cataracts and hurricanoes")["input_ids"]
    prefill(pair, "p-3", ids)
    p = pair["prefill"]
    expired = p.stats().kv_transfer_leases_expired
    settle(p, until=lambda: all_free(p), timeout=3)
    assert settled(pair) and p.stats().kv_transfer_leases_expired == expired + 1


def test_a_zmq_consumer_pulls_from_any_producer(pair, plain, tok):
    """Every producer answers inline (TCP) pulls: a ZmqConnector decode engine needs no match."""
    ids = tok(TEXT + " BENVOLIO: Here comes the furious Tybalt back again")["input_ids"]
    ref, _ = run(plain, "ref-4", ids)
    params = prefill(pair, "p-4", ids)
    z = make_core("kv_consumer", pull_timeout_s=1.0)
    try:
        check_remote_prefill(params, z.kv_transfer.describe(), ids, TRUST)
        toks, _ = run(z, "z-4", ids, params=params)
        assert toks == ref and z.stats().kv_transfer_blocks_received == len(params["remote_block_ids"])
        assert z.kv_transfer.connector.stats.pulls_via == {"inline": 1} and z.stats().kv_transfer_inline_pulls == 1
    finally:
        z.shutdown()
    assert settled(pair)


def test_a_zmq_producer_given_to_this_consumer_means_a_local_prefill(pair, plain, tok, caplog):
    """Past the frontend's refusal (the core alone): the producer refuses a pull (or pairing) over a path it lacks
    at once, not at the pull timeout, and the request prefills locally with the right tokens; nothing is held."""
    ids = tok(TEXT + " ROMEO: He jests at scars that never felt a wound")["input_ids"]
    ref, _ = run(plain, "ref-z", ids)
    z = make_core("producer", lease_timeout_s=1.0)
    try:
        params = run(z, "pz", ids, PREFILL, {"do_remote_decode": True})[1].kv_transfer_params
        d = pair["decode"]
        before = d.stats().kv_transfer_fallbacks
        with caplog.at_level("WARNING", logger="fulcrum.engine.kv_transfer.transfer"):
            toks, _ = run(d, "d-z", ids, params=params)
        assert toks == ref and d.stats().kv_transfer_fallbacks == before + 1
        assert "refused" in caplog.text and "no answer" not in caplog.text
        settle(z, until=lambda: all_free(z))
        assert all_free(z)
    finally:
        z.shutdown()
    assert settled(pair)


def test_shm_consumer_killed_after_the_answer_segment_goes_with_the_lease(tok):
    """A consumer that got its segment's name and died before it released: the lease's end unlinks it."""
    p = make_core("producer", kv_connector="ShmConnector", lease_timeout_s=1.0)
    try:
        ids = tok("HAMLET: To be, or not to be, that is the question: Whether tis nobler in the mind")["input_ids"]
        params = run(p, "p-5", ids, PREFILL, {"do_remote_decode": True})[1].kv_transfer_params
        head = {"id": params["remote_request_id"], "blocks": params["remote_block_ids"], "nonce": 1, "via": "shm"}
        kind, info = ask(params["remote_host"], params["remote_port"], b"pull", head)  # gone without a release
        assert kind == b"ok" and info["via"] == "shm" and os.path.exists(info["path"])
        assert os.path.getsize(info["path"]) == sum(info["sizes"]) == info["bytes"] > 0
        settle(p, until=lambda: all_free(p), timeout=3)
        assert all_free(p) and not os.path.exists(info["path"]) and live_segments() == []
    finally:
        p.shutdown()


def test_shm_producer_close_unlinks_answered_segments():
    """Segments answered but not yet released go when the producer closes; those a killed producer left are swept
    by the next one."""
    cache = torch.randn(2, 2, 8, 16, 4)  # [k/v, layers, blocks, block, dim]
    prod = SharedMemoryConnector([(cache, 2)], True, False)
    cons = SharedMemoryConnector([(torch.zeros_like(cache), 2)], False, True)
    try:
        prod.offer("t1", [1, 3])
        _, info = ask(*prod.address, b"pull", {"id": "t1", "blocks": [1, 3], "nonce": 1, "via": "shm"})
        seg = torch.from_file(info["path"], size=info["bytes"] // 4, dtype=torch.float32).view(2, 2, 2, 16, 4)
        assert torch.equal(seg.movedim(0, 2), cache[:, :, [1, 3]])  # the bytes are the blocks', in order
        assert os.path.exists(info["path"])
    finally:
        prod.close()
        cons.close()
    assert not os.path.exists(info["path"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = f"/dev/shm/{own_prefix(int(dead.stdout))}0-1"
    elsewhere = f"/dev/shm/fulcrum-kv-0another-{int(dead.stdout)}-0-1"  # another host's (a container's) name
    for path in (stale, elsewhere):
        open(path, "wb").close()
    try:
        assert sweep_dead_segments() >= 1 and not os.path.exists(stale) and os.path.exists(elsewhere)
    finally:
        os.unlink(elsewhere)


def test_torch_distributed_pair_ends_when_its_consumer_never_joins(tok):
    """A consumer that asked to pair and died before it built the group: the producer's half times out and the
    pair is gone; a pull naming it is refused (the consumer would pair again)."""
    p = make_core("producer", kv_connector="P2pNcclConnector", lease_timeout_s=2.0, pull_timeout_s=0.5)
    try:
        conn = p.kv_transfer.connector
        assert conn.backend == "gloo"
        kind, info = ask(*conn.address, b"pair", {"nonce": 1})
        assert kind == b"ok" and info["backend"] == "gloo" and info["pair"] in conn._out
        deadline = time.time() + 10
        while info["pair"] in conn._out and time.time() < deadline:
            time.sleep(0.05)
        assert info["pair"] not in conn._out
        ids = tok("OTHELLO: Keep up your bright swords, for the dew will rust them")["input_ids"]
        params = run(p, "p-6", ids, PREFILL, {"do_remote_decode": True})[1].kv_transfer_params
        head = {"id": params["remote_request_id"], "blocks": params["remote_block_ids"], "nonce": 2, "via": "p2p",
                "pair": info["pair"]}  # fmt: skip
        kind, err = ask(*conn.address, b"pull", head)
        assert kind == b"err" and "pair again" in err["error"]
        settle(p, until=lambda: all_free(p), timeout=4)
        assert all_free(p)
    finally:
        p.shutdown()


def test_torch_distributed_one_pair_per_consumer(plain, tok):
    """Two decode engines pulling from one prefill engine: a group each, both answers right, both groups gone once
    the consumers close."""
    p = make_core("producer", kv_connector="TorchDistributedConnector", lease_timeout_s=2.0)
    decodes = [make_core("consumer", kv_connector="TorchDistributedConnector", pull_timeout_s=2.0) for _ in "ab"]
    try:
        for i, d in enumerate(decodes):
            ids = tok(f"{'ROMEO' if i else 'JULIET'}: " + TEXT)["input_ids"]
            ref, _ = run(plain, f"ref-two-{i}", ids)
            params = run(p, f"p-two-{i}", ids, PREFILL, {"do_remote_decode": True})[1].kv_transfer_params
            toks, _ = run(d, f"d-two-{i}", ids, params=params)
            assert toks == ref and d.kv_transfer.connector.stats.pulls_via == {"p2p": 1}
        assert len(p.kv_transfer.connector._out) == 2
    finally:
        for d in decodes:
            d.shutdown()
    conn = p.kv_transfer.connector
    deadline = time.time() + 3
    while conn._out and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert conn._out == {}
        settle(p, until=lambda: all_free(p))
        assert all_free(p)
    finally:
        p.shutdown()


def test_handshake_refuses_data_paths_that_cannot_meet(pair, tok):
    ids = tok("FALSTAFF: If sack and sugar be a fault, God help the wicked!")["input_ids"]
    params = prefill(pair, "p-7", ids)
    local = pair["decode"].kv_transfer.describe()
    check_remote_prefill(params, local, ids, TRUST)  # the real pair agrees
    with pytest.raises(KVTransferError, match="the prefill engine offers zmq"):
        check_remote_prefill({**params, "kv_transport": "zmq"}, local, ids, TRUST)
    if pair["name"] == "SharedMemoryConnector":
        with pytest.raises(KVTransferError, match="needs the prefill engine on this host"):
            check_remote_prefill({**params, "host_id": "elsewhere/1234"}, local, ids, TRUST)
    assert settled(pair)


def test_connector_names():
    for name, transport in [("SharedMemoryConnector", "shm"), ("ShmConnector", "shm"),
                            ("TorchDistributedConnector", "torch.distributed"),
                            ("P2pNcclConnector", "torch.distributed"), ("ZmqConnector", "zmq")]:  # fmt: skip
        assert KVTransferConfig.parse({"kv_role": "kv_both", "kv_connector": name}).transport == transport
