"""The CPU connector: KV blocks pulled between engine processes over ZeroMQ (TCP, or any ZMQ transport), one
frame of raw tensor bytes per block and cache tensor, never a pickle. It is also the control channel the other
connectors (shared memory, torch.distributed) subclass: they keep its messages and bookkeeping and replace only
where the bytes go (`_ship`, `_land`). Tensors are copied outside the GIL, beside the step loop (`ZmqConnector`)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import warnings
from collections import deque

import msgspec
import torch
import zmq

from fulcrum.engine.kv_transfer.base import ConnectorStats, KVConnector, PullJob, PullResult

log = logging.getLogger(__name__)
POLL_MS = 100
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict)


class PullEnded(RuntimeError):
    """A pull that ended with the data path intact (refused, or cancelled): nothing to reset."""


class ZmqConnector(KVConnector):
    """A producer answers pulls on a ROUTER socket from a thread of its own; a consumer pulls from a worker thread with
    one DEALER socket per producer. A pull is [b"pull", msgpack header] -> [b"ok", header, frame per block...] or
    [b"err", message]; the consumer then sends [b"release", header] so that the producer frees the blocks at once
    instead of at the lease's end. The header's "via" names the data path ("inline": these frames); every producer
    serves inline pulls, so a ZmqConnector consumer can pull from any producer. Tensors are read and written outside
    the GIL (torch copies), beside the step loop: only blocks the core reserved for the transfer are touched."""

    transport = "zmq"  # what the handshake calls this connector's data path (config.CONNECTORS)

    def __init__(
        self,
        caches: list[tuple[torch.Tensor, int]],
        produce: bool,
        consume: bool,
        host: str = "127.0.0.1",
        port: int = 0,
        pull_timeout_s: float = 10.0,
    ):
        """`caches`: each paged cache tensor (values, and scales when quantized) with the axis of its blocks."""
        self.caches = caches
        self.pull_timeout_s = pull_timeout_s
        self.stats = ConnectorStats()
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._offered: dict[str, frozenset[int]] = {}
        self._reading: dict[str, int] = {}  # transfer -> pulls reading its blocks now
        self._released: deque[str] = deque()
        self._consume = consume
        # one worker (thread, queue, socket) per producer: a dead producer stalls only the pulls bound for it
        self._workers: dict[tuple[str, int], queue.Queue[PullJob | None]] = {}
        self._results: deque[PullResult] = deque()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._address = None
        self._host = host
        self._nonces = itertools.count(1)
        if produce:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            url = f"tcp://{host}"
            port = self._router.bind_to_random_port(url) if port == 0 else (self._router.bind(f"{url}:{port}"), port)[1]
            self._address = (host, port)
            self._threads.append(threading.Thread(target=self._serve, name="kv-producer", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def address(self) -> tuple[str, int] | None:
        return self._address

    def block_nbytes(self) -> int:
        return sum(c.select(axis, 0).numel() * c.element_size() for c, axis in self.caches)

    def handshake(self) -> dict:
        """What a producer adds to kv_transfer_params and a consumer to its describe(), for config.transport_problem."""
        return {"kv_transport": self.transport}

    # -- producer ---------------------------------------------------------------------------------

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offered[transfer_id] = frozenset(block_ids)

    def withdraw(self, transfer_id: str) -> bool:
        with self._lock:
            if self._reading.get(transfer_id):
                return False
            self._offered.pop(transfer_id, None)
        self._drop(transfer_id)
        return True

    def _drop(self, transfer_id: str, release: dict | None = None) -> None:
        """The transfer ended (`release`: the consumer's release message, when it said so; None: expired,
        withdrawn or closed): free what the data path kept for it."""

    def released(self) -> list[str]:
        out = []
        while self._released:
            out.append(self._released.popleft())
        return out

    def _serve(self) -> None:
        sock = self._router
        try:
            while not self._stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    continue  # not ours: a stray peer must not end the thread
                ident, kind, payload = frames
                try:
                    head = _dec.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if kind == b"release":
                    self._drop(str(head.get("id")), head)
                    self._released.append(str(head.get("id")))
                elif kind == b"pull":
                    sock.send_multipart([ident, *self._answer(head)], copy=False)
                else:
                    reply = self._control(kind, head)
                    if reply is not None:
                        sock.send_multipart([ident, *reply], copy=False)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.error("the KV producer socket failed: %s", e)
        finally:
            sock.close(0)

    def _answer(self, head: dict) -> list:
        tid, blocks = str(head.get("id")), head.get("blocks")
        with self._lock:
            offered = self._offered.get(tid)
            ok = (
                offered is not None
                and isinstance(blocks, list)
                and all(isinstance(b, int) and b in offered for b in blocks)
            )
            if ok:
                self._reading[tid] = self._reading.get(tid, 0) + 1
        if not ok:
            why = "unknown or expired transfer" if offered is None else "blocks outside the transfer"
            return [b"err", _enc.encode({"nonce": head.get("nonce"), "error": f"{why}: {tid}"})]
        try:
            frames, extra, nbytes = self._ship(tid, blocks, head)
        except Exception as e:  # the data path failed (a pair gone, no room): this pull's, the consumer falls back
            log.warning("KV pull of %s failed on the producer: %s", tid, e)
            return [b"err", _enc.encode({"nonce": head.get("nonce"), "error": f"{type(e).__name__}: {e}"})]
        finally:
            with self._lock:
                self._reading[tid] -= 1
                if not self._reading[tid]:
                    del self._reading[tid]
        self.stats.bytes_sent += nbytes
        self.stats.blocks_sent += len(blocks)
        header = _enc.encode({"nonce": head.get("nonce"), "blocks": len(blocks), "bytes": nbytes, **extra})
        return [b"ok", header, *frames]

    def _ship(self, tid: str, blocks: list[int], head: dict) -> tuple[list, dict, int]:
        """Copy `blocks` out of the cache for the pull `head` (the lease may end as soon as this returns): the
        frames to answer with, header fields for the consumer's `_land`, the bytes moved."""
        if head.get("via", "inline") != "inline":
            raise ValueError(f"this producer ({type(self).__name__}) does not serve {head.get('via')!r} pulls")
        copies = self._gather(blocks, "cpu")
        frames = [copy[i] for i in range(len(blocks)) for copy in copies]
        nbytes = sum(f.numel() * f.element_size() for f in frames)
        return [memoryview(f.view(torch.uint8).numpy()) for f in frames], {"via": "inline"}, nbytes

    def _gather(self, blocks: list[int], device: str | None = None) -> list[torch.Tensor]:
        """One contiguous copy of the blocks per cache tensor, [blocks, *block shape], on `device` (None: the
        cache's own; a device cache bound for the host is gathered on the device, then copied down once)."""
        out = []
        for c, axis in self.caches:
            shape = [len(blocks), *c.select(axis, 0).shape]
            t = torch.stack([c.select(axis, b) for b in blocks]) if blocks else c.new_empty(shape)
            out.append(t if device is None else t.to(device))
        return out

    def _control(self, kind: bytes, head: dict) -> list | None:
        """A message other than pull and release (a subclass's, e.g. pairing): its reply, or None for none. One
        this producer does not know is refused at once, so that a consumer of another kind falls back now rather
        than at its pull timeout."""
        return [b"err", _enc.encode({"nonce": head.get("nonce"), "error": f"unknown message {kind!r} here"})]

    # -- consumer ---------------------------------------------------------------------------------

    def pull(self, job: PullJob) -> None:
        if not self._consume:
            raise RuntimeError("this connector was made for a producer only")
        key = (job.host, job.port)
        jobs = self._workers.get(key)
        if jobs is None:
            jobs = self._workers[key] = queue.Queue()
            t = threading.Thread(target=self._work, args=(key, jobs), name=f"kv-pull-{job.port}", daemon=True)
            self._threads.append(t)
            t.start()
        jobs.put(job)

    def finished_pulls(self) -> list[PullResult]:
        self._done.clear()
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def wait(self, timeout: float) -> None:
        if not self._results:
            self._done.wait(timeout)

    def _work(self, key: tuple[str, int], jobs: queue.Queue) -> None:
        sock = None
        while not self._stop.is_set():
            job = jobs.get()
            if job is None:
                break
            t0 = time.perf_counter()
            try:
                if sock is None:
                    sock = self._ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(f"tcp://{key[0]}:{key[1]}")
                n = self._pull(sock, job)
                result = PullResult(job.request_id, True, num_bytes=n, seconds=time.perf_counter() - t0)
                if job.local_block_ids:  # a release-only pull moves nothing: not a transfer
                    with self._lock:
                        self.stats.pulls += 1
                        self.stats.bytes_received += n
                        self.stats.blocks_received += len(job.local_block_ids)
                        self.stats.pull_seconds += result.seconds
            except Exception as e:  # any failure is this request's: it prefills locally instead
                if not isinstance(e, PullEnded):
                    if sock is not None:
                        sock.close(0)  # a late answer must not meet the next pull
                        sock = None
                    self._reset(key)
                result = PullResult(job.request_id, False, error=str(e) or type(e).__name__)
            self._results.append(result)
            self._done.set()
        if sock is not None:
            self._leave(sock, key)
            sock.close(0)

    def _ask(self, sock: zmq.Socket, kind: bytes, head: dict, where: str) -> tuple[bytes, dict, list]:
        """Send one request on the control channel and wait for its answer: (kind, header, frames)."""
        nonce = next(self._nonces)
        sock.send_multipart([kind, _enc.encode({**head, "nonce": nonce})])
        deadline = time.monotonic() + self.pull_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"no answer from {where} in {self.pull_timeout_s:g} s")
            kind, head, *frames = sock.recv_multipart(copy=False)
            info = _dec.decode(head.bytes)
            if info.get("nonce") == nonce:
                return kind.bytes, info, frames  # an answer to an earlier, timed-out request is dropped

    def _pull_head(self, sock: zmq.Socket, job: PullJob) -> dict:
        """The pull header's data-path fields (a subclass may set up its path here, over `sock`)."""
        return {"via": "inline"}

    def _reset(self, key: tuple[str, int]) -> None:
        """A pull to this producer failed: forget what the data path set up with it."""

    def _leave(self, sock: zmq.Socket, key: tuple[str, int]) -> None:
        """The consumer closes: tell this producer so that it frees what the data path keeps for us."""

    def _pull(self, sock: zmq.Socket, job: PullJob) -> int:
        head = {"id": job.transfer_id, "blocks": job.remote_block_ids, **self._pull_head(sock, job)}
        kind, info, frames = self._ask(sock, b"pull", head, f"{job.host}:{job.port}")
        if kind != b"ok":
            raise PullEnded(f"the producer refused the pull: {info.get('error')}")
        release = {"id": job.transfer_id}
        try:
            total = self._land(job, info, frames)
            release.update(self._released_head(info))  # `_land` returned: done with what it read the blocks from
            if job.local_block_ids and not job.cancelled:
                via = str(info.get("via", "inline"))
                with self._lock:
                    self.stats.pulls_via[via] = self.stats.pulls_via.get(via, 0) + 1
        finally:
            sock.send_multipart([b"release", _enc.encode(release)])  # done with the blocks, whatever came
        if job.cancelled:
            raise PullEnded("cancelled")
        return total

    def _released_head(self, info: dict) -> dict:
        """What the release of a landed answer tells the producer besides the transfer (a subclass's data path)."""
        return {}

    def _land(self, job: PullJob, info: dict, frames: list) -> int:
        """Write the answer's blocks into `job.local_block_ids` (none once the job is cancelled): bytes moved."""
        if info.get("via", "inline") != "inline":
            raise RuntimeError(f"the producer answered a {info.get('via')!r} pull this connector cannot read")
        if len(frames) != len(job.local_block_ids) * len(self.caches):
            raise RuntimeError(f"the producer sent {len(frames)} frames for {len(job.local_block_ids)} blocks")
        total, i = 0, 0
        staged: list[list[torch.Tensor]] = [[] for _ in self.caches]  # a device cache's blocks, copied up at once
        with warnings.catch_warnings():  # ZMQ frames are read-only; torch only reads them here
            warnings.simplefilter("ignore", UserWarning)
            for b in job.local_block_ids:
                if job.cancelled:
                    break
                for j, (c, axis) in enumerate(self.caches):
                    dst = c.select(axis, b)
                    buf = frames[i].buffer
                    if buf.nbytes != dst.numel() * dst.element_size():
                        raise RuntimeError(f"a block of {buf.nbytes} bytes where this cache has {dst.numel()}")
                    src = torch.frombuffer(buf, dtype=torch.uint8).view(c.dtype).view(dst.shape)
                    if c.device.type == "cpu":
                        dst.copy_(src)
                    else:
                        staged[j].append(src)
                    total += buf.nbytes
                    i += 1
        for (c, axis), srcs in zip(self.caches, staged):
            if srcs and not job.cancelled:
                ids = torch.tensor(job.local_block_ids[: len(srcs)], device=c.device)
                c.index_copy_(axis, ids, torch.stack(srcs).to(c.device).movedim(0, axis))
        return total

    def _scatter(self, job: PullJob, copies: list[torch.Tensor]) -> int:
        """Write one [blocks, *block shape] tensor per cache into the job's blocks (a data path's `_land`)."""
        total = 0
        for (c, axis), src in zip(self.caches, copies):
            want = [len(job.local_block_ids), *c.select(axis, 0).shape]
            if list(src.shape) != want or src.dtype != c.dtype:
                raise RuntimeError(f"blocks of shape {list(src.shape)} {src.dtype} where this cache has {want}")
            if not job.cancelled and job.local_block_ids:
                ids = torch.tensor(job.local_block_ids, device=c.device)
                c.index_copy_(axis, ids, src.to(c.device).movedim(0, axis))
            total += src.numel() * src.element_size()
        return total

    def close(self) -> None:
        self._stop.set()
        for jobs in self._workers.values():
            jobs.put(None)
        for t in self._threads:
            t.join(2)
        self._ctx.destroy(linger=0)
        with self._lock:
            ended = list(self._offered)
            self._offered.clear()
        for tid in ended:
            self._drop(tid)
