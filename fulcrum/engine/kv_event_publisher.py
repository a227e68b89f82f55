"""KV-cache events over ZeroMQ in vLLM's schema and wire format (fulcrum/utils/kv_event_schema.py), so that a router
(ours, llm-d's, Dynamo's) that reads vLLM's events can read ours: which block hashes a replica's cache holds.

The KV cache manager records BlockStored and BlockRemoved, the publisher AllBlocksCleared when it starts (a restarted
replica's old entries are gone); the engine core hands each step's events to `EventPublisher.publish`."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgspec

from fulcrum.errors import InvalidRequestError
from fulcrum.utils.kv_event_schema import END_SEQ, AllBlocksCleared, EventBatch

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
    max_queue_size: int = 100_000  # accepted from vLLM's configs; nothing queues here (hwm bounds the socket)
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
    """publish() encodes a step's events (msgspec msgpack, as vLLM) and hands them to ZeroMQ without blocking, as
    [topic, 8-byte big-endian sequence number, payload]: a PUB socket never waits for a subscriber (beyond `hwm`
    queued messages it drops, and the subscriber sees the gap in the sequence numbers), and ZeroMQ's own I/O thread,
    which needs no GIL, does the sending. A Python thread that woke to send would stall the step loop on the GIL
    whenever the OS preempted it mid-send (the publisher's cost per step, measured:
    benchmarks/results/router/summary-events.txt). The last `buffer_steps` batches are kept for the replay socket
    (ROUTER), whose thread sleeps in zmq's poll until a consumer asks: a request carrying a start sequence number is
    answered with every buffered batch from it as [topic, seq, payload], then [b"", sequence -1, b""]."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int | None = None):
        import zmq

        self.cfg, self.rank = cfg, data_parallel_rank
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = cfg.topic.encode()
        self.dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._replay = self._thread = None
        self._stop = threading.Event()
        try:
            self._pub.bind(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            where = cfg.replay_endpoint if self._pub.get(zmq.LAST_ENDPOINT) else cfg.endpoint
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)
            self._ctx.term()
            raise InvalidRequestError(f"kv_events_config: cannot bind {where}: {e}", "kv_events_config") from e
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self._thread.start()
        self.publish([AllBlocksCleared()])  # whatever a subscriber knew of an earlier run of this replica is gone

    def publish(self, events: list) -> None:
        import zmq

        if not events:
            return
        seq = next(self._seq)
        payload = self._encoder.encode(EventBatch(time.time(), events, self.rank))
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        except zmq.ZMQError:  # events are advisory: a broken socket must never take the engine down
            self.dropped += 1
            log.exception("publishing KV events failed")

    def close(self) -> None:
        self._stop.set()
        self._pub.close()  # lingers up to 500 ms for what is still queued
        if self._thread is not None:
            self._thread.join(2)
        if self._thread is not None and self._thread.is_alive():
            self._ctx.destroy(linger=0)  # term() would wait for the replay thread's socket
        else:
            self._ctx.term()

    def _serve_replay(self) -> None:
        """Every buffered batch from the sequence a consumer asks for, then an empty payload under END_SEQ. The
        step loop appends to the buffer meanwhile: list() copies it in one go under the GIL."""
        import zmq

        sock = self._replay
        try:
            while not self._stop.is_set():
                if not sock.poll(500):
                    continue
                frames = sock.recv_multipart()
                client, start = frames[0], frames[-1]  # REQ clients put an empty delimiter between
                envelope = [client, b""] if len(frames) > 2 else [client]
                first = int.from_bytes(start, "big") if len(start) == 8 else 0
                # as vLLM answers: each batch as the live stream has it (topic, seq, payload), then (b"", END_SEQ, b"")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        sock.send_multipart([*envelope, self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                sock.send_multipart([*envelope, b"", END_SEQ, b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.warning("the KV-events replay socket stopped: %s", e)
        finally:
            sock.close(0)


def medium_of(device: str) -> str:
    return "GPU" if str(device).startswith("cuda") else "CPU"
