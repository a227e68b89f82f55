"""The CPU connector: KV blocks pulled between engine processes over ZeroMQ (TCP, or any ZMQ transport), one
frame of raw tensor bytes per block and cache tensor, never a pickle.

A producer answers pulls on a ROUTER socket from a thread of its own; a consumer pulls from a worker thread with
one DEALER socket per producer. A pull is [b"pull", msgpack header] -> [b"ok", header, frame per block...] or
[b"err", message]; the consumer then sends [b"release", header] so that the producer frees the blocks at once
instead of at the lease's end. Tensors are read and written outside the GIL (torch copies), beside the step loop:
only blocks the core reserved for the transfer are touched."""

from __future__ import annotations

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


class ZmqConnector(KVConnector):
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

    # -- producer ---------------------------------------------------------------------------------

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offered[transfer_id] = frozenset(block_ids)

    def withdraw(self, transfer_id: str) -> bool:
        with self._lock:
            if self._reading.get(transfer_id):
                return False
            self._offered.pop(transfer_id, None)
            return True

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
                    self._released.append(str(head.get("id")))
                elif kind == b"pull":
                    sock.send_multipart([ident, *self._answer(head)], copy=False)
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
            # one copy of the blocks per cache tensor, in host memory (a device cache is gathered there first, then
            # copied down once): the bytes leave from our copy, so the lease may end as soon as this returns
            copies = [torch.stack([c.select(axis, b) for b in blocks]).cpu() if blocks else None
                      for c, axis in self.caches]  # fmt: skip
            frames = [copy[i] for i in range(len(blocks)) for copy in copies]
        finally:
            with self._lock:
                self._reading[tid] -= 1
                if not self._reading[tid]:
                    del self._reading[tid]
        nbytes = sum(f.numel() * f.element_size() for f in frames)
        self.stats.bytes_sent += nbytes
        self.stats.blocks_sent += len(blocks)
        header = _enc.encode({"nonce": head.get("nonce"), "blocks": len(blocks), "bytes": nbytes})
        return [b"ok", header, *(memoryview(f.view(torch.uint8).numpy()) for f in frames)]

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
        nonce = 0
        while not self._stop.is_set():
            job = jobs.get()
            if job is None:
                break
            nonce += 1
            t0 = time.perf_counter()
            try:
                if sock is None:
                    sock = self._ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(f"tcp://{key[0]}:{key[1]}")
                n = self._pull(sock, job, nonce)
                result = PullResult(job.request_id, True, num_bytes=n, seconds=time.perf_counter() - t0)
                if job.local_block_ids:  # a release-only pull moves nothing: not a transfer
                    with self._lock:
                        self.stats.pulls += 1
                        self.stats.bytes_received += n
                        self.stats.blocks_received += len(job.local_block_ids)
                        self.stats.pull_seconds += result.seconds
            except Exception as e:  # any failure is this request's: it prefills locally instead
                if sock is not None:
                    sock.close(0)  # a late answer must not meet the next pull
                    sock = None
                result = PullResult(job.request_id, False, error=str(e) or type(e).__name__)
            self._results.append(result)
            self._done.set()
        if sock is not None:
            sock.close(0)

    def _pull(self, sock: zmq.Socket, job: PullJob, nonce: int) -> int:
        sock.send_multipart([b"pull", _enc.encode({"id": job.transfer_id, "blocks": job.remote_block_ids,
                                                   "nonce": nonce})])  # fmt: skip
        deadline = time.monotonic() + self.pull_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"no answer from {job.host}:{job.port} in {self.pull_timeout_s:g} s")
            kind, head, *frames = sock.recv_multipart(copy=False)
            info = _dec.decode(head.bytes)
            if info.get("nonce") == nonce:
                break  # an answer to an earlier, timed-out pull is dropped
        if kind.bytes != b"ok":
            raise RuntimeError(f"the producer refused the pull: {info.get('error')}")
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
        sock.send_multipart([b"release", _enc.encode({"id": job.transfer_id})])  # done with them, whatever came
        if job.cancelled:
            raise RuntimeError("cancelled")
        return total

    def close(self) -> None:
        self._stop.set()
        for jobs in self._workers.values():
            jobs.put(None)
        for t in self._threads:
            t.join(2)
        self._ctx.destroy(linger=0)
