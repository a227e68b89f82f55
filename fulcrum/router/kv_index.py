"""Precise prefix routing's index: which replica holds which block, kept from each replica's KV-cache events
(vLLM's ZeroMQ stream, fulcrum/utils/kv_event_schema.py).

Blocks are keyed by the router's own chained hash (fulcrum/utils/hashing.py), computed from the token ids and the
parent that each BlockStored carries, so the index does not depend on how the replica hashes: vLLM's sha256 (as
bytes or truncated to an int) with its per-process seed, or fulcrum's xxh3. Per replica a map from its hashes to
ours lets BlockRemoved, which names only the replica's hashes, apply (as llm-d's KV-cache manager does). A stored
block is not indexed when it cannot be placed (its parent is not in the map: missed or evicted, or a router that
joined mid-stream) or when its hash covers more than tokens (LoRA adapter, multimodal inputs, cache salt): no
prompt's hash would ever equal it.

A replica's entries are dropped when it says AllBlocksCleared, when its sequence numbers jump (missed batches:
replayed from its replay socket when it has one and the batches are still buffered there) or go back (a restarted
publisher), and when the pool sees it fail."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from fulcrum.utils.hashing import NONE_HASH, hash_block_tokens
from fulcrum.utils.kv_event_schema import END_SEQ, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, decoder

log = logging.getLogger("fulcrum.router")
REPLAY_TIMEOUT_S = 1.0

Where = tuple[str | None, int | None]  # (medium, group_idx): one copy of a block at the replica


@dataclass
class ReplicaBlocks:
    held: dict[int, set[Where]] = field(default_factory=dict)  # our hash -> where the replica holds the block
    ours: dict[BlockHash, int] = field(default_factory=dict)  # the replica's hash -> ours
    block_size: int | None = None  # from its BlockStored events
    last_seq: int | None = None
    drops: int = 0  # times its entries were dropped (restart, gap, failure)
    unplaced: int = 0  # stored blocks not indexed: parent unknown, or tokens missing
    unmatchable: int = 0  # stored blocks not indexed: hashed with more than tokens (LoRA, multimodal, salt)

    @property
    def hashes(self) -> set[int]:
        """Our hashes of the blocks the replica holds."""
        return set(self.held)

    def clear(self) -> None:
        self.held.clear()
        self.ours.clear()

    def store(self, ev: BlockStored) -> None:
        where = (ev.medium, ev.group_idx)
        if ev.group_idx in (None, 0):
            self.block_size = ev.block_size
        n, bs = len(ev.block_hashes), ev.block_size
        if ev.lora_name is not None or ev.lora_id is not None:
            self.unmatchable += n
            return
        extra = ev.extra_keys or ()
        parent = NONE_HASH if ev.parent_block_hash is None else self.ours.get(ev.parent_block_hash)
        for i, theirs in enumerate(ev.block_hashes):
            mine = self.ours.get(theirs)  # already placed: another copy of it (another medium or group)
            if mine is None:
                if i < len(extra) and extra[i]:
                    self.unmatchable += n - i  # and those after it, which chain from it
                    return
                if parent is None or len(ev.token_ids) < (i + 1) * bs:
                    self.unplaced += n - i
                    return
                mine = hash_block_tokens(parent, ev.token_ids[i * bs : (i + 1) * bs])
                self.ours[theirs] = mine
            self.held.setdefault(mine, set()).add(where)
            parent = mine

    def remove(self, ev: BlockRemoved) -> None:
        for theirs in ev.block_hashes:
            mine = self.ours.get(theirs)
            if mine is None:
                continue  # never indexed
            copies = self.held.get(mine, set())
            where = (ev.medium, ev.group_idx)
            if where in copies:
                copies.discard(where)
            else:  # named unlike its store (say without the group): a hit it cannot serve costs more than a miss
                copies -= {c for c in copies if c[0] == ev.medium} or set(copies)
            if not copies:
                self.held.pop(mine, None)
                del self.ours[theirs]


class KVIndex:
    def __init__(self):
        self.replicas: dict[str, ReplicaBlocks] = {}

    def of(self, url: str) -> ReplicaBlocks:
        return self.replicas.setdefault(url, ReplicaBlocks())

    def drop(self, url: str) -> None:
        r = self.of(url)
        r.clear()
        r.drops += 1

    def cached_prefix(self, url: str, hashes: list[int]) -> int:
        """How many of `hashes` (our chained hashes of a prompt's blocks) the replica holds, from the first."""
        held = self.of(url).held
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def gap(self, url: str, seq: int) -> bool:
        """True when `seq` does not follow the last one applied (missed batches, or a restarted publisher)."""
        last = self.of(url).last_seq
        return last is not None and seq != last + 1

    def restarted(self, url: str) -> None:
        """The replica's publisher started over (its sequence went back): nothing it said before holds."""
        self.drop(url)
        self.of(url).last_seq = None

    def apply(self, url: str, seq: int, batch) -> None:
        r = self.of(url)
        if r.last_seq is not None and seq <= r.last_seq:
            return  # already applied (a replayed batch that the live stream also brought)
        if self.gap(url, seq):
            log.warning("KV events of %s: sequence %d after %d; its entries are dropped", url, seq, r.last_seq)
            self.drop(url)
        r.last_seq = seq
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                r.store(ev)
            elif isinstance(ev, BlockRemoved):
                r.remove(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.drop(url)


class Subscriber:
    """One replica's event stream into the index: a SUB socket read by an asyncio task of the router's loop."""

    def __init__(self, index: KVIndex, url: str, endpoint: str, replay_endpoint: str | None = None, topic: str = ""):
        self.index, self.url, self.endpoint, self.replay_endpoint = index, url, endpoint, replay_endpoint
        self.topic = topic
        self.decode = decoder()
        self.received = 0  # batches applied, for tests and logs

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        live_last = None
        try:
            if self.replay_endpoint:  # what the replica cached before this router started
                await self._replay(ctx, 0)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                try:
                    batch = self.decode.decode(frames[2])
                except Exception as e:  # a malformed batch: this replica's state is unknown now
                    log.warning("KV events of %s: undecodable batch %d (%s)", self.url, seq, e)
                    self.index.drop(self.url)
                    continue
                if live_last is not None and seq <= live_last:  # one publisher's stream only goes up
                    log.info("KV events of %s restarted at sequence %d; its entries are dropped", self.url, seq)
                    self.index.restarted(self.url)
                live_last = seq
                # batches before this one that this router has not seen (a gap, or the start of a stream it joined
                # late, after a restart too): the replay socket has them while they are buffered
                r = self.index.of(self.url)
                expected = 0 if r.last_seq is None else r.last_seq + 1
                if self.replay_endpoint and seq > expected:
                    await self._replay(ctx, expected, until=seq)
                self.index.apply(self.url, seq, batch)
                self.received += 1
        finally:
            sock.close(0)

    async def _replay(self, ctx: zmq.asyncio.Context, start: int, until: int | None = None) -> None:
        """Ask the replay socket for the batches from `start`; a missing start (fell out of its buffer) is a gap
        that apply() answers by dropping the replica's entries."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while await sock.poll(REPLAY_TIMEOUT_S * 1000):
                frames = await sock.recv_multipart()
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_SEQ or not payload:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if until is not None and seq >= until:
                    continue
                self.index.apply(self.url, seq, self.decode.decode(payload))
        except Exception as e:
            log.warning("KV events of %s: replay from %s failed (%s)", self.url, self.replay_endpoint, e)
        finally:
            sock.close(0)


class Subscriptions:
    """Every replica's subscriber, started and stopped with the router."""

    def __init__(self, index: KVIndex):
        self.index = index
        self.ctx: zmq.asyncio.Context | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.subscribers: dict[str, Subscriber] = {}

    def add(self, sub: Subscriber) -> None:
        self.subscribers[sub.url] = sub
        if self.ctx is not None:
            self._start(sub)

    def _start(self, sub: Subscriber) -> None:
        self.tasks[sub.url] = asyncio.get_running_loop().create_task(sub.run(self.ctx))

    def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        for sub in self.subscribers.values():
            self._start(sub)

    def remove(self, url: str) -> None:
        self.subscribers.pop(url, None)
        if task := self.tasks.pop(url, None):
            task.cancel()
        self.index.replicas.pop(url, None)

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.ctx is not None:
            self.ctx.term()
