"""The one-host connector: a pull's blocks go through a file in /dev/shm (tmpfs) instead of TCP frames, with the
ZMQ connector's control channel, leases and releases unchanged: one copy into a segment the producer owns, one out
of it into the consumer's cache (measured: benchmarks/results/cpu-kv-connectors.log). Where /dev/shm has no room for
a segment, the answer falls back to inline frames (the consumer reads either)."""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import socket
import warnings
from pathlib import Path

import torch
import xxhash

from fulcrum.engine.kv_transfer.base import PullJob
from fulcrum.engine.kv_transfer.zmq_connector import ZmqConnector

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
PREFIX = "fulcrum-kv-"
POOL_BYTES = 64 << 20  # released segments kept for reuse, at most


def host_id() -> str:
    """Who shares /dev/shm: the kernel's boot id and the host name (two containers on one kernel differ by name)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


def host_prefix() -> str:
    """The names of this host's segments: a tag of the host name (containers that share /dev/shm but not a pid
    namespace must not sweep each other's)."""
    return f"{PREFIX}{xxhash.xxh32_hexdigest(socket.gethostname().encode())}-"


def own_prefix(pid: int | None = None) -> str:
    """The names of one process's segments (this one's by default)."""
    return f"{host_prefix()}{os.getpid() if pid is None else pid}-"


def sweep_dead_segments(directory: str = SHM_DIR) -> int:
    """Unlink this host's segments whose producer process is gone (killed before it could clean up): how many."""
    n, mine = 0, host_prefix()
    for path in glob.glob(os.path.join(directory, mine + "*")):
        try:
            pid = int(os.path.basename(path)[len(mine) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                n += 1
        except (ValueError, PermissionError):
            continue  # not ours, or a live process of another user
    return n


def live_segments(directory: str = SHM_DIR) -> list[str]:
    """This process's segments (the tests count them)."""
    return sorted(glob.glob(os.path.join(directory, own_prefix() + "*")))


class SharedMemoryConnector(ZmqConnector):
    """The producer copies the requested blocks once, straight from its cache into a segment (one per pull, one
    [blocks, *block shape] run per cache tensor), and answers with the segment's name; the consumer maps it read-only
    and copies once into its cache. A segment the consumer released (its release names it: it has unmapped it) goes
    back to a small pool for the next pull, up to `POOL_BYTES`, since a fresh tmpfs segment costs a page fault and a
    zeroed page per 4 KiB, the larger part of a pull's time. Every other end of a transfer unlinks its segments: the
    lease's expiry or early end (a consumer killed before it released, or two consumers of one transfer: only the one
    that released gives its segment back), and close, which unlinks the pool too. Segments a killed producer left are
    swept by the next producer started on the host (the names carry the creator's pid). Unlinking a segment a
    consumer still maps is safe: the pages live until it unmaps."""

    transport = "shm"

    def __init__(self, *args, shm_dir: str = SHM_DIR, **kw):
        super().__init__(*args, **kw)
        self._dir = shm_dir
        self._segments: dict[str, list[str]] = {}  # transfer -> its segments' paths
        self._pool: dict[str, int] = {}  # released segments, reusable: path -> size
        self._seq = 0
        if self._address is not None:
            swept = sweep_dead_segments(shm_dir)
            if swept:
                log.warning("removed %d KV segments left in %s by killed producers", swept, shm_dir)

    def handshake(self) -> dict:
        return {**super().handshake(), "host_id": host_id()}

    # -- producer ---------------------------------------------------------------------------------

    def _ship(self, tid: str, blocks: list[int], head: dict) -> tuple[list, dict, int]:
        if head.get("via") != "shm" or not blocks:  # a release-only pull moves nothing: no segment for it
            return super()._ship(tid, blocks, {**head, "via": "inline"} if head.get("via") == "shm" else head)
        sizes = [len(blocks) * c.select(axis, 0).numel() * c.element_size() for c, axis in self.caches]
        total = sum(sizes)
        with self._lock:
            path = min((p for p, n in self._pool.items() if n >= total), key=self._pool.get, default=None)
            if path is not None:
                del self._pool[path]
            else:
                self._seq += 1
                path = os.path.join(self._dir, f"{own_prefix()}{id(self):x}-{self._seq}")
            self._segments.setdefault(tid, []).append(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < total:
                try:
                    # reserve the pages now: a write past a full tmpfs through a mapping is SIGBUS, this is ENOSPC
                    os.posix_fallocate(fd, 0, total)
                except OSError as e:
                    self._unlink(tid, path)
                    log.warning("no room in %s for %d bytes (%s): this pull goes inline", self._dir, total, e)
                    return super()._ship(tid, blocks, {**head, "via": "inline"})
            with mmap.mmap(fd, total) as mm:
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                offset = 0
                for (c, axis), size in zip(self.caches, sizes):
                    dst = buf[offset : offset + size].view(c.dtype).view(len(blocks), *c.select(axis, 0).shape)
                    if c.device.type == "cpu":
                        torch.stack([c.select(axis, b) for b in blocks], out=dst)
                    else:  # gathered on the device, copied down once
                        dst.copy_(torch.stack([c.select(axis, b) for b in blocks]))
                    offset += size
                del buf, dst  # the mapping closes only once no tensor views it
        finally:
            os.close(fd)
        return [], {"via": "shm", "path": path, "sizes": sizes}, total

    def _unlink(self, tid: str, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with self._lock:
            paths = self._segments.get(tid)
            if paths and path in paths:
                paths.remove(path)
                if not paths:
                    del self._segments[tid]

    def _drop(self, transfer_id: str, release: dict | None = None) -> None:
        done = release.get("path") if release else None
        with self._lock:
            paths = self._segments.pop(transfer_id, [])
            if done in paths and not self._stop.is_set():
                paths.remove(done)
                with contextlib.suppress(OSError):
                    size = os.stat(done).st_size
                    if sum(self._pool.values()) + size <= POOL_BYTES:
                        self._pool[done] = size
                        done = None
                if done is not None:
                    paths.append(done)
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        super().close()
        with self._lock:
            left = list(self._segments)
            pooled, self._pool = list(self._pool), {}
        for tid in left:  # answered pulls whose transfer the core had already let go
            self._drop(tid)
        for path in pooled:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def pooled(self) -> list[str]:
        """Released segments kept for reuse (the tests tell them from leaked ones)."""
        with self._lock:
            return sorted(self._pool)

    # -- consumer ---------------------------------------------------------------------------------

    def _pull_head(self, sock, job: PullJob) -> dict:
        return {"via": "shm"}

    def _released_head(self, info: dict) -> dict:
        return {"path": info["path"]} if info.get("via") == "shm" else {}

    def _land(self, job: PullJob, info: dict, frames: list) -> int:
        if info.get("via") != "shm":
            return super()._land(job, info, frames)
        path, sizes = str(info.get("path")), info.get("sizes")
        if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != self._dir:
            raise RuntimeError(f"the producer named a segment outside {self._dir}: {path}")
        fd = os.open(path, os.O_RDONLY)  # gone (the lease ended meanwhile): FileNotFoundError, a local prefill
        try:
            total = os.fstat(fd).st_size
            if not isinstance(sizes, list) or sum(sizes) > total or len(sizes) != len(self.caches):
                raise RuntimeError(f"segment {path} holds {total} bytes, the answer describes {sizes}")
            if not job.local_block_ids:
                return 0
            with mmap.mmap(fd, sum(sizes), access=mmap.ACCESS_READ) as mm, warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only mapping; torch only reads it
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                copies, offset = [], 0
                for (c, axis), size in zip(self.caches, sizes):
                    n = len(job.local_block_ids)
                    copies.append(buf[offset : offset + size].view(c.dtype).view(n, *c.select(axis, 0).shape))
                    offset += size
                moved = self._scatter(job, copies)
                del buf, copies
            return moved
        finally:
            os.close(fd)
