"""KV-cache events over ZeroMQ in vLLM's schema and wire format (fulcrum/utils/kv_events.py), so that a router
(ours, llm-d's, Dynamo's) that reads vLLM's events can read ours: which block hashes a replica's cache holds.

The KV cache manager records BlockStored when a full block is registered under its hash, BlockRemoved when a
cached block is evicted for reuse, AllBlocksCleared when the publisher starts (a restarted replica's old entries
are gone). The engine core hands one step's events to `EventPublisher.publish`, which only queues them: a
thread encodes each batch (msgspec msgpack, array-like structs tagged by class name, as vLLM), sends it on a PUB
socket as [topic, 8-byte big-endian sequence number, payload], and keeps the last `buffer_steps` batches for the
replay socket (ROUTER: a request carrying a start sequence number is answered with every buffered batch from it,
then an empty payload under sequence -1).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgspec

from fulcrum.errors import InvalidRequestError
from fulcrum.utils.kv_events import END_SEQ, AllBlocksCleared, EventBatch

log = logging.getLogger(__name__)


# -- vLLM's kv_events_config ---------------------------------------------------------------------------------------


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig, its names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: dict | None) -> KVEventsConfig | None:
        """None unless events are on and published. Unknown keys are refused: a half-applied config hides typos."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidRequestError("kv_events_config must be a JSON object", "kv_events_config")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise InvalidRequestError(
                f"kv_events_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                "kv_events_config",
            )
        cfg = cls(**value)
        if cfg.publisher is None:
            cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
        checks = {
            "publisher": cfg.publisher in ("zmq", "null"),
            "endpoint": isinstance(cfg.endpoint, str) and "://" in cfg.endpoint,
            "replay_endpoint": cfg.replay_endpoint is None or "://" in str(cfg.replay_endpoint),
            "buffer_steps": isinstance(cfg.buffer_steps, int) and cfg.buffer_steps > 0,
            "hwm": isinstance(cfg.hwm, int) and cfg.hwm >= 0,
            "max_queue_size": isinstance(cfg.max_queue_size, int) and cfg.max_queue_size > 0,
            "topic": isinstance(cfg.topic, str),
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(
                    f"kv_events_config: {name} has an invalid value: {getattr(cfg, name)!r}", "kv_events_config"
                )
        if not cfg.enable_kv_cache_events or cfg.publisher == "null":
            return None
        return cfg


def for_rank(value: dict | None, rank: int) -> dict | None:
    """A data-parallel rank's kv_events_config: its ports plus the rank (as vLLM offsets them), so that the engine
    cores behind one server do not fight over one endpoint."""
    if not value or rank == 0:
        return value
    out = dict(value)
    for key in ("endpoint", "replay_endpoint"):
        if out.get(key):
            out[key] = _offset(out[key], rank)
    return out


def _offset(endpoint: str | None, rank: int) -> str | None:
    if not endpoint or rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}"


# -- the publisher -------------------------------------------------------------------------------------------------


class EventPublisher:
    """publish() queues a step's events and returns; a daemon thread owns the sockets (ZeroMQ sockets are not
    thread-safe), so a slow or absent subscriber never stalls the step loop. Beyond `max_queue_size` batches
    waiting, new ones are dropped (the subscriber sees the gap in the sequence numbers)."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int | None = None):
        self.cfg, self.rank = cfg, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(cfg.max_queue_size)
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._bound.wait(10)
        if self._error is not None:
            raise InvalidRequestError(
                f"kv_events_config: cannot bind {cfg.endpoint}: {self._error}", "kv_events_config"
            ) from self._error
        self.publish([AllBlocksCleared()])  # whatever a subscriber knew of an earlier run of this replica is gone

    def publish(self, events: list) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(EventBatch(time.time(), events, self.rank))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)  # after what is queued: those batches still go out
        except queue.Full:
            log.warning("the KV-events queue is full at shutdown: %d batches not sent", self._queue.qsize())
        self._thread.join(timeout)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        pub.setsockopt(zmq.LINGER, 500)
        replay = None
        try:
            pub.bind(self.cfg.endpoint)
            if self.cfg.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            self._bound.set()
            pub.close(0)
            if replay is not None:
                replay.close(0)
            ctx.term()
            return
        self._bound.set()
        topic = self.cfg.topic.encode()
        try:
            while True:
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    batch = False
                if batch is None:
                    return
                if batch:
                    seq = next(self._seq)
                    payload = self._encoder.encode(batch)
                    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
                    self._buffer.append((seq, payload))
                if replay is not None:
                    self._serve_replay(replay)
        except Exception:  # events are advisory: a failure here must never take the engine down
            log.exception("the KV-events publisher stopped")
        finally:
            pub.close()
            if replay is not None:
                replay.close(0)
            ctx.term()

    def _serve_replay(self, sock) -> None:
        import zmq

        while sock.poll(0):
            frames = sock.recv_multipart()
            client, start = frames[0], frames[-1]  # REQ clients put an empty delimiter between
            envelope = [client, b""] if len(frames) > 2 else [client]
            first = int.from_bytes(start, "big") if len(start) == 8 else 0
            for seq, payload in list(self._buffer):
                if seq >= first:
                    sock.send_multipart([*envelope, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            sock.send_multipart([*envelope, END_SEQ, b""], flags=zmq.NOBLOCK)


def medium_of(device: str) -> str:
    return "GPU" if str(device).startswith("cuda") else "CPU"
