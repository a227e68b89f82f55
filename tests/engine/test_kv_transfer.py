"""KV transfer between two engine cores in this process, over the ZeroMQ connector on loopback TCP: greedy output
through a producer and a consumer equals one engine's, only the blocks the consumer lacks move, every block comes
back on both sides (finished, aborted, failed and unpulled transfers), and a mismatched pair is refused."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from fulcrum.config import DEFAULT_MODEL, EngineConfig
from fulcrum.engine.core import EngineCore
from fulcrum.engine.kv_transfer import KVTransferConfig, KVTransferError, check_remote_prefill
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.tokenizer import load_tokenizer
from tests.engine.stepping import run_request

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PREFILL = SamplingParams(max_tokens=1, temperature=0)
TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 3


SECRET = "the pair's own"  # producers sign their kv_transfer_params with it, consumers check them
TRUST = KVTransferConfig.parse({"kv_role": "kv_consumer", "secret": SECRET})  # a consumer's, for the handshake


def make_core(role: str, **kw) -> EngineCore:
    cfg = {"kv_role": role, "secret": SECRET, **kw}
    return EngineCore(EngineConfig(kv_cache_memory=40 << 20, cpu_threads=1, cpu_bind="none", kv_transfer_config=cfg))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def cores():
    made = {
        "plain": EngineCore(EngineConfig(kv_cache_memory=40 << 20, cpu_threads=1, cpu_bind="none")),
        "prefill": make_core("producer", lease_timeout_s=1.0),
        "decode": make_core("kv_consumer", pull_timeout_s=1.0),
    }
    yield made
    for c in made.values():
        if c.kv_transfer is not None:
            c.kv_transfer.close()


def run(core: EngineCore, rid: str, ids, sp=GREEDY, params=None):
    """Step the core until `rid` ends: (its tokens, its last output)."""
    return run_request(core, rid, ids, sp, params)


def settle(*cores, until=lambda: True, timeout=5.0):
    """Idle ticks (as the core process's loop makes them) until `until()` holds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for c in cores:
            c.housekeeping()
        if until():
            return
        time.sleep(0.05)


def all_free(core: EngineCore) -> bool:
    s = core.stats()
    return s.num_free_blocks == s.num_blocks and s.kv_transfer_held_blocks == 0 and s.kv_transfer_pending == 0


def prefill(cores, rid, ids):
    toks, out = run(cores["prefill"], rid, ids, PREFILL, {"do_remote_decode": True})
    assert out.finish_reason == "length" and len(toks) == 1
    return out.kv_transfer_params


def test_prefill_then_decode_equals_one_engine(cores, tok):
    ids = tok(TEXT)["input_ids"]
    ref, _ = run(cores["plain"], "ref", ids)
    params = prefill(cores, "p-1", ids)
    assert params["do_remote_prefill"] and params["num_prompt_tokens"] == len(ids)
    assert len(params["remote_block_ids"]) == (len(ids) - 1) // 16
    assert cores["prefill"].stats().kv_transfer_held_blocks == len(params["remote_block_ids"])
    before = cores["decode"].stats()
    toks, out = run(cores["decode"], "d-1", ids, params=params)
    assert toks == ref and out.finish_reason == "length"
    after = cores["decode"].stats()
    assert after.kv_transfer_blocks_received - before.kv_transfer_blocks_received == len(params["remote_block_ids"])
    assert after.kv_transfer_fallbacks == before.kv_transfer_fallbacks
    # the consumer's release frees the producer's lease at once, long before it would expire
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]), timeout=0.8)
    assert all_free(cores["prefill"]) and all_free(cores["decode"])


def test_only_missing_blocks_move_with_prefix_hits_on_both_sides(cores, tok):
    shared = tok(TEXT)["input_ids"]
    ids = shared + tok(" JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father")["input_ids"]
    ref, _ = run(cores["plain"], "ref-2", ids)
    # the decode engine already holds the shared prefix (an earlier request); the prefill engine too
    run(cores["decode"], "warm", shared, SamplingParams(max_tokens=1, temperature=0))
    run(cores["prefill"], "warm", shared, SamplingParams(max_tokens=1, temperature=0))
    params = prefill(cores, "p-2", ids)
    assert cores["prefill"].stats().prefix_cache_hits > 0
    before = cores["decode"].stats()
    toks, _ = run(cores["decode"], "d-2", ids, params=params)
    assert toks == ref
    got = cores["decode"].stats().kv_transfer_blocks_received - before.kv_transfer_blocks_received
    assert got == (len(ids) - 1) // 16 - len(shared) // 16  # the shared blocks stayed home
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))
    assert all_free(cores["prefill"]) and all_free(cores["decode"])


def test_unpulled_lease_expires_and_frees(cores, tok):
    ids = tok("KING LEAR: Blow, winds, and crack your cheeks! rage! blow! You cataracts and hurricanoes")["input_ids"]
    prefill(cores, "p-3", ids)
    p = cores["prefill"]
    expired = p.stats().kv_transfer_leases_expired
    assert p.stats().kv_transfer_held_blocks > 0
    settle(p, until=lambda: all_free(p), timeout=3)
    assert all_free(p) and p.stats().kv_transfer_leases_expired == expired + 1


def test_consumer_gone_mid_pull_lease_expires(cores, tok):
    """A consumer that asks for the blocks and vanishes before it releases them (killed mid-pull): the producer
    answers into the void and frees the blocks when the lease ends."""
    ids = tok("HAMLET: To be, or not to be, that is the question: Whether tis nobler in the mind")["input_ids"]
    params = prefill(cores, "p-4", ids)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
    head = {"id": params["remote_request_id"], "blocks": params["remote_block_ids"], "nonce": 1}
    s.send_multipart([b"pull", msgspec.msgpack.encode(head)])
    assert s.poll(5000)
    kind, _, *frames = s.recv_multipart()
    assert kind == b"ok" and len(frames) == len(params["remote_block_ids"])
    ctx.destroy(linger=0)  # gone without a release
    p = cores["prefill"]
    settle(p, until=lambda: all_free(p), timeout=3)
    assert all_free(p)


def test_failed_pull_falls_back_to_local_prefill(cores, tok):
    ids = tok(TEXT + " MERCUTIO: A plague on both your houses!")["input_ids"]
    ref, _ = run(cores["plain"], "ref-5", ids)
    params = prefill(cores, "p-5", ids)
    dead = {**params, "remote_port": params["remote_port"] + 1 if params["remote_port"] < 65535 else 1}
    d = cores["decode"]
    before = d.stats().kv_transfer_fallbacks
    toks, out = run(d, "d-5", ids, params=dead)  # nobody listens there: the pull times out
    assert toks == ref and out.error is None
    assert d.stats().kv_transfer_fallbacks == before + 1
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))
    assert all_free(d) and all_free(cores["prefill"])


def test_abort_while_waiting_for_blocks_frees_them(cores, tok):
    ids = tok(TEXT + " TYBALT: What, drawn, and talk of peace!")["input_ids"]
    params = prefill(cores, "p-6", ids)
    d = cores["decode"]
    d.add_request("d-6", ids, GREEDY, kv_transfer_params=params)
    assert d.stats().kv_transfer_pending == 1
    outs = d.abort_requests(["d-6"])
    assert [o.finish_reason for o in outs] == ["abort"]
    settle(d, cores["prefill"], until=lambda: all_free(d) and all_free(cores["prefill"]))
    assert all_free(d) and all_free(cores["prefill"])


def test_handshake_refuses_a_mismatched_pair(cores, tok):
    ids = tok("FALSTAFF: If sack and sugar be a fault, God help the wicked!")["input_ids"]
    params = prefill(cores, "p-7", ids)
    local = cores["decode"].kv_transfer.describe()
    check_remote_prefill(params, local, ids, TRUST)  # the real pair agrees
    bad = {**params, "block_size": 32, "kv_dtype": "bfloat16"}
    with pytest.raises(KVTransferError) as e:
        check_remote_prefill(bad, local, ids, TRUST)
    assert "block_size (prefill engine: 32, this engine: 16)" in str(e.value)
    assert 'kv_dtype (prefill engine: "bfloat16", this engine: "float32")' in str(e.value)
    with pytest.raises(KVTransferError, match="model"):
        check_remote_prefill({**params, "model": "other@123"}, local, ids, TRUST)
    with pytest.raises(KVTransferError, match="kv_layout"):
        check_remote_prefill({**params, "kv_layout": {**params["kv_layout"], "block_shapes": [[1]]}}, local, ids, TRUST)
    other = list(ids)
    other[3] = (other[3] + 1) % 2000  # the same length, another prompt: its blocks are not this one's
    with pytest.raises(KVTransferError, match=r"made for another prompt \(block 0 differs\)"):
        check_remote_prefill(params, local, other, TRUST)
    with pytest.raises(KVTransferError, match="takes no KV"):
        check_remote_prefill(params, None, ids, TRUST)
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))


def test_a_consumer_contacts_only_producers_it_trusts(cores, tok, monkeypatch):
    """Issue 37: kv_transfer_params name the host and port a consumer pulls from, so a client could point it at
    any service. Only a producer's signed params (the pair's shared secret), or a producer the operator listed,
    are taken; anything else is a 400 in the frontend, and a local prefill in the core."""
    monkeypatch.delenv("FULCRUM_KV_TRANSFER_SECRET", raising=False)
    ids = tok("GLOUCESTER: Now is the winter of our discontent made glorious summer")["input_ids"]
    params = prefill(cores, "p-11", ids)
    local = cores["decode"].kv_transfer.describe()
    check_remote_prefill(params, local, ids, TRUST)  # signed by the producer
    forged = {**params, "remote_port": params["remote_port"] + 1}  # elsewhere on this host: never contacted
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    for bad, trust in [(forged, TRUST), (unsigned, TRUST), (params, KVTransferConfig.parse({"kv_role": "kv_consumer",
                                                                                          "secret": "another"}))]:  # fmt: skip
        with pytest.raises(KVTransferError, match="not signed by a producer this engine trusts"):
            check_remote_prefill(bad, local, ids, trust)
    open_door = KVTransferConfig.parse({"kv_role": "kv_consumer"})
    with pytest.raises(KVTransferError, match="contacts only producers it trusts"):
        check_remote_prefill(params, local, ids, open_door)
    listed = KVTransferConfig.parse({"kv_role": "kv_consumer", "allowed_producers": [
        f"{params['remote_host']}:{params['remote_port']}"]})  # fmt: skip
    check_remote_prefill(unsigned, local, ids, listed)
    # the core, for an offline caller: the forged request prefills locally, right tokens, nothing pulled
    ref, _ = run(cores["plain"], "ref-11", ids)
    d = cores["decode"]
    before = d.stats()
    toks, _ = run(d, "d-11", ids, params=forged)
    assert toks == ref
    after = d.stats()
    assert after.kv_transfer_fallbacks == before.kv_transfer_fallbacks + 1
    assert after.kv_transfer_blocks_received == before.kv_transfer_blocks_received
    with pytest.raises(InvalidRequestError, match="allowed_producers"):
        KVTransferConfig.parse({"kv_role": "kv_consumer", "allowed_producers": ["nohost"]})
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))


def test_config_spellings_and_errors():
    assert KVTransferConfig.parse(None, "producer").kv_role == "kv_producer"
    cfg = KVTransferConfig.parse('{"kv_connector": "ZmqConnector", "kv_role": "kv_both", '
                                 '"kv_connector_extra_config": {"lease_timeout_s": 5}}')  # fmt: skip
    assert cfg.produces and cfg.consumes and cfg.lease_timeout_s == 5
    assert KVTransferConfig.parse(None) is None
    for bad, match in [
        ({"kv_role": "decoder"}, "kv_role must be one of"),
        ({"kv_role": "kv_both", "kv_connector": "NixlConnector"}, "not available"),
        ({"kv_role": "kv_both", "lease": 3}, "unknown field"),
        ({"kv_role": "kv_both", "lease_timeout_s": 0}, "positive"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            KVTransferConfig.parse(bad)
    with pytest.raises(InvalidRequestError, match="contradicts"):
        KVTransferConfig.parse({"kv_role": "kv_consumer"}, "producer")


def test_full_local_hit_releases_the_producer_at_once(cores, tok):
    """A decode engine that already holds every block pulls none, and tells the producer so: its lease ends now,
    not when it expires."""
    ids = tok(TEXT + " NURSE: Even or odd, of all days in the year")["input_ids"]
    ref, _ = run(cores["plain"], "ref-8", ids)
    run(cores["decode"], "warm-8", ids, SamplingParams(max_tokens=1, temperature=0))
    params = prefill(cores, "p-8", ids)
    d, p = cores["decode"], cores["prefill"]
    got = d.stats().kv_transfer_blocks_received
    toks, _ = run(d, "d-8", ids, params=params)
    assert toks == ref and d.stats().kv_transfer_blocks_received == got
    expired = p.stats().kv_transfer_leases_expired
    settle(p, until=lambda: all_free(p), timeout=0.8)  # well before the 1 s lease would end
    assert all_free(p) and p.stats().kv_transfer_leases_expired == expired


def test_stray_and_malformed_messages_leave_the_producer_serving(cores, tok):
    ids = tok(TEXT + " PRINCE: Rebellious subjects, enemies to peace")["input_ids"]
    params = prefill(cores, "p-9", ids)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
    s.send_multipart([b"garbage"])
    s.send_multipart([b"pull", b"\xff\x00not msgpack"])
    s.send_multipart([b"pull", msgspec.msgpack.encode({"id": params["remote_request_id"], "blocks": [10**9],
                                                       "nonce": 7})])  # fmt: skip
    assert s.poll(5000)
    kind, head = s.recv_multipart()
    assert kind == b"err" and b"outside the transfer" in head
    ctx.destroy(linger=0)
    ref, _ = run(cores["plain"], "ref-9", ids)
    toks, _ = run(cores["decode"], "d-9", ids, params=params)  # the real pull still works
    assert toks == ref
    assert cores["decode"].stats().kv_transfer_fallbacks == cores["decode"].kv_transfer.fallbacks
    bad = {**params, "remote_port": "9", "remote_block_ids": [1, "x"]}
    with pytest.raises(KVTransferError, match="remote_port, remote_block_ids has the wrong type"):
        check_remote_prefill(bad, cores["decode"].kv_transfer.describe(), ids, TRUST)
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))
    assert all_free(cores["prefill"]) and all_free(cores["decode"])


def test_other_requests_run_while_one_waits_for_its_blocks(cores, tok):
    """A pull that hangs (nobody answers; 1 s timeout here) holds only its own request: another one starts and
    finishes meanwhile, then the first falls back to a local prefill with the right tokens."""
    ids = tok(TEXT + " CAPULET: Go to, go to!")["input_ids"]
    ref, _ = run(cores["plain"], "ref-10", ids)
    params = prefill(cores, "p-10", ids)
    d = cores["decode"]
    hung = {**params, "remote_port": params["remote_port"] + 1}  # a trusted producer that went silent
    hung["signature"] = TRUST.sign(hung)
    d.add_request("d-10", ids, GREEDY, kv_transfer_params=hung)
    other = tok("LADY CAPULET: What, are you busy, ho?")["input_ids"]
    other_ref, _ = run(cores["plain"], "ref-10b", other)
    d.add_request("other", other, GREEDY)
    got: dict[str, list[int]] = {"d-10": [], "other": []}
    t0, other_done = time.time(), None
    while d.has_unfinished_requests() and time.time() - t0 < 30:
        for o in d.step():
            got[o.request_id] += o.new_token_ids
            if o.request_id == "other" and o.finish_reason:
                other_done = d.stats().kv_transfer_pending
    assert got["other"] == other_ref and other_done == 1  # finished while d-10 still waited for its blocks
    assert got["d-10"] == ref
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))
    assert all_free(d) and all_free(cores["prefill"])


def test_kv_transfer_refuses_tensor_parallel_engines():
    with pytest.raises(InvalidRequestError, match="tensor or pipeline parallelism"):
        EngineConfig(kv_transfer_config={"kv_role": "kv_both"}, tensor_parallel_size=2)


def test_structured_output_request_pulls_its_blocks_too(cores, tok):
    """A request with a grammar joins the scheduler after its compile: through the pull when it asks for one."""
    from fulcrum.sampling_params import StructuredOutputsParams

    ids = tok(TEXT + " Who loves Juliet?")["input_ids"]
    sp = SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=["Romeo", "Paris"])
    )
    ref, _ = run(cores["plain"], "ref-11", ids, sp)
    params = prefill(cores, "p-11", ids)
    d = cores["decode"]
    got = d.stats().kv_transfer_blocks_received
    toks, out = run(d, "d-11", ids, sp, params)
    assert toks == ref and out.kv_transfer_params is None
    assert d.stats().kv_transfer_blocks_received > got
    settle(cores["prefill"], until=lambda: all_free(cores["prefill"]))
    assert all_free(d) and all_free(cores["prefill"])


def test_leases_past_their_share_of_the_cache_end_oldest_first(tok):
    """Prefills nobody pulls hold at most max_held_fraction of the producer's cache: the oldest lease ends early."""
    p = make_core("producer", lease_timeout_s=60, max_held_fraction=0.02)  # 320 blocks: at most 6 held
    try:
        ids = [tok(f"{who}: " + TEXT)["input_ids"] for who in ("ROMEO", "JULIET", "NURSE")]
        params = [run(p, f"p{i}", x, PREFILL, {"do_remote_decode": True})[1].kv_transfer_params
                  for i, x in enumerate(ids)]  # fmt: skip
        each = len(params[0]["remote_block_ids"])
        assert each >= 3
        s = p.stats()
        assert s.kv_transfer_held_blocks <= max(6, each) and s.kv_transfer_leases_expired >= 1
        assert s.num_blocks - s.num_free_blocks == s.kv_transfer_held_blocks  # nothing else is held
        assert params[-1]["remote_request_id"] in p.kv_transfer.leases  # the newest stays
        assert params[0]["remote_request_id"] not in p.kv_transfer.leases
    finally:
        p.shutdown()
