"""The torch.distributed connector: a pull's blocks move as send/recv of cache tensors inside a 2-rank process group
of the producer (rank 0) and one consumer (rank 1): NCCL when the cache is on a CUDA device (device to device, no
host copy), gloo on the CPU, one code path for both. Control (pull, release, leases) stays the ZMQ connector's.
A producer keeps one group per consumer it served, which fits a fixed fleet of decode engines, not consumers that
come and go (`TorchDistConnector`). Written for CUDA, run here on gloo only."""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import zmq

from fulcrum.engine.kv_transfer.base import PullJob
from fulcrum.engine.kv_transfer.zmq_connector import ZmqConnector, _enc

log = logging.getLogger(__name__)


def route_to(host: str) -> str:
    """This host's address on the route to `host` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


@dataclass
class Pair:
    store: object
    group: object = None
    ready: threading.Event = field(default_factory=threading.Event)
    sends: queue.Queue = field(default_factory=queue.Queue)  # (tensors, tag), None to stop


class TorchDistConnector(ZmqConnector):
    """Pairing: a consumer's first pull to a producer sends [b"pair"] on the control channel; the producer starts a
    TCPStore on a free port and answers with it, then both sides build the group over that store (each group is its
    own object, never torch.distributed's default group, so that one producer holds one group per consumer and the
    engine's own tensor-parallel world, were there one, is untouched). The group lives as long as the pair: a send or
    recv that fails or times out (pull_timeout_s) ends it, and the next pull pairs again; a consumer that closes says
    [b"unpair"].

    The limit: a producer keeps one group (a TCPStore, a gloo connection or an NCCL communicator with its buffers) per
    consumer it has served, until that consumer closes or a send to it fails; a consumer killed without closing
    leaves its idle group there until then or until the producer closes. Consumers that come and go belong on ZMQ or
    shared memory. With NCCL, a peer that dies mid-transfer trips NCCL's watchdog, which by default ends the
    surviving process too (TORCH_NCCL_ASYNC_ERROR_HANDLING): NCCL's failure model, not gloo's, which only times out."""

    transport = "torch.distributed"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        device = self.caches[0][0].device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._pair_ids = itertools.count(1)
        self._out: dict[int, Pair] = {}  # producer: pair id -> its group and sender
        self._in: dict[tuple[str, int], tuple[object, object, int]] = {}  # consumer: producer -> (group, store, id)

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.pull_timeout_s)

    def _group(self, store, rank: int, local_ip: str):
        """This side of a pair's group; gloo listens on `local_ip`, the address the peer reaches (the host name
        may resolve to a loopback address only this host can use)."""
        prefix = dist.PrefixStore("kv", store)
        if self.backend == "nccl":
            torch.cuda.set_device(self.caches[0][0].device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout()
            return dist.ProcessGroupNCCL(prefix, rank, 2, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self._timeout()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        return dist.ProcessGroupGloo(prefix, rank, 2, opts)

    # -- producer ---------------------------------------------------------------------------------

    def _control(self, kind: bytes, head: dict) -> list | None:
        if kind == b"unpair":
            pair = self._out.pop(head.get("pair"), None)
            if pair is not None:
                pair.sends.put(None)
            return None
        if kind != b"pair":
            return super()._control(kind, head)
        try:
            store = dist.TCPStore(self._host, 0, 2, True, timeout=self._timeout(), wait_for_workers=False)
        except Exception as e:
            return [b"err", _enc.encode({"nonce": head.get("nonce"), "error": f"no store for the pair: {e}"})]
        pid = next(self._pair_ids)
        pair = self._out[pid] = Pair(store)
        t = threading.Thread(target=self._send_loop, args=(pid, pair), name=f"kv-pair-{pid}", daemon=True)
        self._threads.append(t)
        t.start()
        return [b"ok", _enc.encode({"nonce": head.get("nonce"), "pair": pid, "store_port": store.port,
                                    "backend": self.backend})]  # fmt: skip

    def _send_loop(self, pid: int, pair: Pair) -> None:
        try:
            pair.group = self._group(pair.store, 0, self._host)
            pair.ready.set()
            while not self._stop.is_set():
                try:
                    item = pair.sends.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is None:
                    break
                tensors, tag = item
                for t in tensors:
                    pair.group.send([t], 1, tag).wait()
        except Exception as e:  # the consumer is gone or stuck: the pair ends, its next pull pairs again
            log.warning("KV pair %d ended: %s", pid, e)
        finally:
            self._out.pop(pid, None)
            pair.ready.set()

    def _ship(self, tid: str, blocks: list[int], head: dict) -> tuple[list, dict, int]:
        if head.get("via") != "p2p" or not blocks:
            return super()._ship(tid, blocks, {**head, "via": "inline"} if head.get("via") == "p2p" else head)
        pair = self._out.get(head.get("pair"))
        if pair is None or not pair.ready.wait(self.pull_timeout_s) or pair.group is None:
            raise ValueError(f"no process group with this consumer (pair {head.get('pair')}): pair again")
        copies = self._gather(blocks)  # on the cache's device: NCCL sends from there
        tag = int(head.get("nonce") or 0) & 0x7FFFFFFF
        pair.sends.put((copies, tag))
        return [], {"via": "p2p", "tag": tag}, sum(t.numel() * t.element_size() for t in copies)

    def close(self) -> None:
        for pair in list(self._out.values()):
            pair.sends.put(None)
        super().close()

    # -- consumer ---------------------------------------------------------------------------------

    def _pull_head(self, sock, job: PullJob) -> dict:
        key = (job.host, job.port)
        if key not in self._in:
            kind, info, _ = self._ask(sock, b"pair", {}, f"{job.host}:{job.port}")
            if kind != b"ok":
                raise RuntimeError(f"the producer refused to pair: {info.get('error')}")
            if info.get("backend") != self.backend:
                raise RuntimeError(f"the producer's cache moves over {info.get('backend')}, this one's over "
                                   f"{self.backend}")  # fmt: skip
            store = dist.TCPStore(job.host, int(info["store_port"]), 2, False, timeout=self._timeout())
            self._in[key] = (self._group(store, 1, route_to(job.host)), store, int(info["pair"]))
        return {"via": "p2p", "pair": self._in[key][2]}

    def _land(self, job: PullJob, info: dict, frames: list) -> int:
        if info.get("via") != "p2p":
            return super()._land(job, info, frames)
        group = self._in[(job.host, job.port)][0]
        n = len(job.local_block_ids)
        bufs = []
        for c, axis in self.caches:  # all of them, even once cancelled: the producer's sends must be matched
            buf = c.new_empty([n, *c.select(axis, 0).shape])
            group.recv([buf], 0, int(info["tag"])).wait()  # NCCL: the current stream waits, not this thread
            bufs.append(buf)
        moved = self._scatter(job, bufs)
        if self.backend == "nccl":  # the pull is done when the blocks are in, not when their copy is queued
            torch.cuda.current_stream(self.caches[0][0].device).synchronize()
        return moved

    def _reset(self, key: tuple[str, int]) -> None:
        self._in.pop(key, None)

    def _leave(self, sock, key: tuple[str, int]) -> None:
        pair = self._in.pop(key, None)
        if pair is not None:
            sock.setsockopt(zmq.LINGER, 200)  # the close right after must not drop it
            sock.send_multipart([b"unpair", _enc.encode({"pair": pair[2]})])
