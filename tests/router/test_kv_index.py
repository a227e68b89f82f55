"""The kv-events index against a replica that hashes unlike the router: events produced the way vLLM 0.32 produces
them (sha256 over a pickle of (parent hash, token ids, extra keys), the chain seeded from PYTHONHASHSEED; hashes
published as the digest's low 64 bits by default, as the 32-byte digest with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0;
a batch an array, its events maps tagged by "type"). The index keys blocks by the router's own hash of their
tokens, so a shared prefix still goes to the holder; removals name the replica's hashes; blocks the router cannot
reproduce (unknown parent, LoRA, multimodal or salted hashes) are left out."""

from __future__ import annotations

import hashlib
import pickle
import time

import httpx
import msgspec
import pytest
import zmq

from fulcrum.router.kv_index import KVIndex
from fulcrum.utils.hashing import hash_prefix_blocks
from fulcrum.utils.kv_event_schema import decoder
from fulcrum.utils.serve_process import free_port
from tests.router.conftest import run_router
from tests.router.test_router import complete

BLOCK = 16


class VllmReplica:
    """A vLLM replica's side of the events: its block hashes and the payloads it publishes."""

    def __init__(self, seed: str = "0", int_hashes: bool = True):
        self.int_hashes = int_hashes
        self.none_hash = self._sha256(seed)  # the seed every chain starts from (random without PYTHONHASHSEED)

    @staticmethod
    def _sha256(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def hashes(self, token_ids: list[int], extra_keys: tuple | None = None) -> list[bytes]:
        """The chained hashes of the full blocks, as the replica keeps them (32-byte digests)."""
        out, parent = [], self.none_hash
        for i in range(len(token_ids) // BLOCK):
            parent = self._sha256((parent, tuple(token_ids[i * BLOCK : (i + 1) * BLOCK]), extra_keys))
            out.append(parent)
        return out

    def published(self, h: bytes) -> int | bytes:
        return int.from_bytes(h, "big") & (2**64 - 1) if self.int_hashes else h

    def stored(self, token_ids, first: int = 0, last: int | None = None, lora: str | None = None, extra=None):
        """BlockStored of blocks first..last of a prompt, the parent named as the replica names it."""
        keys = (lora,) if lora else extra
        chain = self.hashes(token_ids, keys)
        last = len(chain) if last is None else last
        return {
            "type": "BlockStored",
            "block_hashes": [self.published(h) for h in chain[first:last]],
            "parent_block_hash": self.published(chain[first - 1]) if first else None,
            "token_ids": list(token_ids[first * BLOCK : last * BLOCK]),
            "block_size": BLOCK,
            "lora_id": 1 if lora else None,
            "medium": "GPU",
            "lora_name": lora,
            "extra_keys": [keys] * (last - first),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",  # a field this router does not know: skipped
        }

    def removed(self, token_ids, blocks: range) -> dict:
        chain = self.hashes(token_ids)
        return {"type": "BlockRemoved", "block_hashes": [self.published(chain[i]) for i in blocks], "medium": "GPU",
                "group_idx": 0}  # fmt: skip


def batch(*events) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


TOKENS = list(range(100, 100 + 5 * BLOCK + 3))  # 5 full blocks and a partial one
OURS = hash_prefix_blocks(TOKENS, BLOCK)


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "bytes"])
def test_foreign_hashes_are_indexed_by_ours_and_removed_by_theirs(int_hashes):
    vllm, dec, index = VllmReplica(int_hashes=int_hashes), decoder(), KVIndex()
    assert vllm.published(vllm.hashes(TOKENS)[0]) not in OURS  # the replica's hashes say nothing to the router
    index.apply("a", 0, dec.decode(batch(vllm.stored(TOKENS, 0, 2))))
    index.apply("a", 1, dec.decode(batch(vllm.stored(TOKENS, 2, 4))))  # chains from a parent it named before
    assert index.cached_prefix("a", OURS) == 4 and index.of("a").block_size == BLOCK
    index.apply("a", 2, dec.decode(batch(vllm.removed(TOKENS, range(1, 2)))))
    assert index.cached_prefix("a", OURS) == 1 and index.of("a").hashes == {OURS[0], OURS[2], OURS[3]}
    index.apply("a", 3, dec.decode(batch({"type": "AllBlocksCleared"})))
    assert index.cached_prefix("a", OURS) == 0 and not index.of("a").ours
    assert index.of("a").unplaced == index.of("a").unmatchable == 0


def test_blocks_the_router_cannot_reproduce_are_not_indexed():
    vllm, dec, index = VllmReplica(), decoder(), KVIndex()
    # a router that joined after the first blocks: their children name a parent it never saw
    index.apply("a", 0, dec.decode(batch(vllm.stored(TOKENS, 2, 4))))
    assert index.of("a").hashes == set() and index.of("a").unplaced == 2
    # an adapter's blocks and a salted prompt's cover more than tokens: no base-model prompt may match them
    index.apply("a", 1, dec.decode(batch(vllm.stored(TOKENS, lora="sonnets"))))
    index.apply("a", 2, dec.decode(batch(vllm.stored(TOKENS, 0, 1, extra=("tenant-a",)))))
    assert index.of("a").hashes == set() and index.of("a").unmatchable == 6
    # fulcrum's own engine names the adapter and publishes no extra keys: not indexed either
    own = {**vllm.stored(TOKENS, 0, 2), "extra_keys": None, "lora_id": None, "lora_name": "sonnets"}
    index.apply("a", 3, dec.decode(batch(own)))
    assert index.of("a").hashes == set() and index.of("a").unmatchable == 8
    # a multimodal block in the middle: it and those chained after it are left out, those before it are kept
    mixed = vllm.stored(TOKENS, 0, 3)
    mixed["extra_keys"] = [None, [["image-hash", 4]], None]
    index.apply("a", 4, dec.decode(batch(mixed)))
    assert index.cached_prefix("a", OURS) == 1 and index.of("a").unmatchable == 10
    # a removal naming blocks never indexed changes nothing
    index.apply("a", 5, dec.decode(batch(vllm.removed(TOKENS, range(1, 5)))))
    assert index.cached_prefix("a", OURS) == 1


def test_a_batch_encoded_as_a_map_decodes_too():
    """vLLM's newer source declares the batch without array_like too: a map {"ts", "events", "data_parallel_rank"}."""
    vllm, index = VllmReplica(), KVIndex()
    keyed = msgspec.msgpack.encode({"ts": 1.0, "events": [vllm.stored(TOKENS, 0, 3)], "data_parallel_rank": 0})
    index.apply("a", 0, decoder().decode(keyed))
    assert index.cached_prefix("a", OURS) == 3


def test_a_copy_in_another_medium_keeps_the_block_until_both_go():
    vllm, index = VllmReplica(), KVIndex()
    dec = decoder()
    index.apply("a", 0, dec.decode(batch(vllm.stored(TOKENS, 0, 2))))
    offloaded = {**vllm.stored(TOKENS, 0, 2), "medium": "CPU", "token_ids": [], "parent_block_hash": None}
    index.apply("a", 1, dec.decode(batch(offloaded)))  # CPU copies of known blocks: no tokens needed
    index.apply("a", 2, dec.decode(batch(vllm.removed(TOKENS, range(0, 2)))))  # the GPU copies are evicted
    assert index.cached_prefix("a", OURS) == 2
    index.apply("a", 3, dec.decode(batch({**vllm.removed(TOKENS, range(0, 2)), "medium": "CPU"})))
    assert index.cached_prefix("a", OURS) == 0 and index.of("a").unplaced == 0


class Publisher:
    """A replica's event socket, bound by the test: XPUB, so that the router's subscription is seen before the
    first batch goes out."""

    def __init__(self, ctx: zmq.Context):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.seq = 0

    def wait_subscribed(self) -> None:
        assert self.sock.poll(30_000), "the router did not subscribe"
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, *events) -> None:
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), batch(*events)])
        self.seq += 1


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_router_sends_a_shared_prefix_to_the_vllm_replica_that_holds_it(replicas):
    """Two replicas whose events carry vLLM's hashes (one publishes ints, the other bytes): a prompt sharing a
    prefix goes to the replica whose events say it holds that prefix, a kv-events decision; when it evicts the
    blocks the request falls back to load."""
    ctx = zmq.Context()
    pubs = {s.url: Publisher(ctx) for s in replicas}
    a, b = (s.url for s in replicas)
    system = "You are the Chorus. O for a Muse of fire, that would ascend the brightest heaven of invention! " * 2
    try:
        with run_router([a, b], policy="kv-events", balance_margin=2,
                        kv_events_endpoints={u: p.endpoint for u, p in pubs.items()}) as r:  # fmt: skip
            for p in pubs.values():
                p.wait_subscribed()
            tokens = r.router.tokenizer.token_ids("completions", {"prompt": system})
            n = len(tokens) // BLOCK
            assert n >= 2
            int_replica, bytes_replica = VllmReplica(seed="1"), VllmReplica(seed="2", int_hashes=False)
            pubs[b].send(bytes_replica.stored(tokens))
            wait_for(lambda: r.router.kv_index.cached_prefix(b, hash_prefix_blocks(tokens, BLOCK)) == n, "b's blocks")
            client = r.client()
            for i in range(3):
                complete(client, prompt=system + f"Question {i}?", max_tokens=1, stream=bool(i % 2))
            assert r.requests_by_replica() == {b: 3} and r.decisions() == {"kv-events": 3}
            # b evicts the prefix, a caches it (the other hash form): the next ones follow
            pubs[b].send(bytes_replica.removed(tokens, range(n)))
            pubs[a].send(int_replica.stored(tokens))
            wait_for(lambda: not r.router.kv_index.of(b).held and r.router.kv_index.of(a).held, "the move")
            complete(client, prompt=system + "Where now?", max_tokens=1)
            assert r.requests_by_replica() == {b: 3, a: 1} and r.decisions() == {"kv-events": 4}
            pubs[a].send({"type": "AllBlocksCleared"})
            wait_for(lambda: not r.router.kv_index.of(a).held, "the clear")
            complete(client, prompt=system + "And now?", max_tokens=1)
            assert r.decisions()["no-prefix"] == 1
            pubs[a].send(int_replica.stored(tokens, 1))  # its parent was cleared: the rest cannot be placed
            wait_for(lambda: r.router.kv_index.of(a).unplaced == n - 1, "the unplaced blocks")
            text = httpx.get(f"{r.url}/metrics").text
            assert f'fulcrum_router:kv_index_skipped_blocks{{reason="unplaced",replica="{a}"}} {n - 1}.0' in text
    finally:
        for p in pubs.values():
            p.sock.close(0)
        ctx.term()
