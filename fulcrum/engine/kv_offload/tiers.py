"""The offload tiers below the KV pool, keyed by the engine's chained block hash (utils/hashing.py): a block found in
any tier holds the same tokens under the same prefix.

- `HostTier` (tier 2): blocks in this process's memory, outside the pool (pinned when the pool is on a GPU), with a
  byte cap and LRU eviction.
- `DiskTier` (tier 3): one file per block under `<dir>/<layout id>/`, read memory-mapped, with a byte cap and LRU
  eviction by modification time (a hit touches its file). The layout id hashes everything a block's bytes depend
  on (model weights, dtype, KV dtype, block size, cache shapes, the hash function), so a directory shared by other
  models or layouts never offers their blocks. Each file carries its hash, layout id and a checksum of its bytes:
  a corrupt, truncated or foreign file is dropped, never read into the cache. Writers write to a temporary name and
  rename, so replicas sharing the directory never see a torn block.

A block's data is a tuple of tensors, one per cache tensor (k/v or the MLA latent, then the quantized cache's
scales), each that block's slice, contiguous on the host."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import torch
import xxhash

log = logging.getLogger(__name__)

BlockData = tuple[torch.Tensor, ...]

FORMAT_VERSION = 1
# how block hashes are made (utils/hashing.py); recorded with the blocks: another scheme makes other keys
HASH_SCHEME = "xxh3_64 chained over int64 token ids, root 0"
MAGIC = b"FKVB"
# magic, format version, layout id, block hash, payload bytes, payload checksum (xxh3_64), padding to 64 bytes
HEADER = struct.Struct("<4sIQQQQ24x")
SUFFIX = ".kvb"
STALE_TMP_S = 600  # a temporary file this old was left by a writer that died


def data_nbytes(data: BlockData) -> int:
    return sum(t.numel() * t.element_size() for t in data)


class Tier(Protocol):
    """What the offload asks of a tier below the pool (the pool itself, tier 1, is the KV cache manager's)."""

    name: str  # in metrics: "ram", "disk"
    capacity: int  # bytes
    used: int  # bytes held now

    def __contains__(self, block_hash: int) -> bool: ...

    def get(self, block_hash: int) -> BlockData | None:
        """The block's data; None when the tier lacks it (a disk tier raises BlockFileError for a bad file)."""

    def put(self, block_hash: int, data: BlockData) -> bool:
        """Keep a block (evicting the least recently used past the cap); False when it was not kept."""


class HostTier:
    """Blocks held in host memory, least recently used evicted first once `capacity` bytes are used. Called from
    the engine core's thread only."""

    name = "ram"

    def __init__(self, capacity: int, pin: bool = False):
        self.capacity, self.pin = capacity, pin
        self.blocks: OrderedDict[int, BlockData] = OrderedDict()
        self.used = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def get(self, block_hash: int) -> BlockData | None:
        data = self.blocks.get(block_hash)
        if data is not None:
            self.blocks.move_to_end(block_hash)
        return data

    def put(self, block_hash: int, data: BlockData) -> bool:
        size = data_nbytes(data)
        if block_hash in self.blocks or size > self.capacity:
            return False
        while self.used + size > self.capacity:
            _, old = self.blocks.popitem(last=False)
            self.used -= data_nbytes(old)
        if self.pin:
            data = tuple(t.pin_memory() for t in data)
        self.blocks[block_hash] = data
        self.used += size
        return True

    def __len__(self) -> int:
        return len(self.blocks)


class BlockFileError(Exception):
    """A block file that cannot be used (missing, truncated, corrupt, another layout's)."""


class DiskTier:
    """Block files under `root/<layout id>/`. `contains` and `read` may run on any thread; writes and evictions run
        on the offload writer's thread. Errors are the caller's to log: `put` raises OSError, `get` BlockFileError (and
    never returns None: the offload asks for blocks it found)."""

    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity: int, layout: dict, shapes: list[tuple], dtypes: list):
        self.root = Path(root)
        self.capacity = capacity
        self.layout = dict(layout, format=FORMAT_VERSION, hash=HASH_SCHEME)
        text = json.dumps(self.layout, sort_keys=True)
        self.layout_id = xxhash.xxh3_64_intdigest(text.encode())
        self.dir = self.root / f"{self.layout_id:016x}"
        self.shapes, self.dtypes = shapes, dtypes
        self.sizes = [
            int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes)
        ]
        self.payload = sum(self.sizes)
        self.file_bytes = HEADER.size + self.payload
        self.lock = threading.Lock()
        self.used = 0  # bytes of block files here, as last scanned plus what this process wrote since
        self.writable = True
        self._open(text)

    # -- startup -----------------------------------------------------------------------------------

    def _open(self, layout_text: str) -> None:
        """Create (or find) this layout's directory, say what the root holds, clear dead writers' temporaries."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            meta = self.dir / "layout.json"
            if not meta.exists():
                self._atomic_write(meta, layout_text.encode())
        except OSError as e:
            self.writable = False
            log.warning("KV offload directory %s is not writable (%s): the disk tier serves what it holds and "
                        "stores nothing", self.root, e.strerror or e)  # fmt: skip
        self._report_others()
        now = time.time()
        count = 0
        for f in self._files(include_tmp=True):
            try:
                st = f.stat()
                if ".tmp." in f.name:
                    if now - st.st_mtime > STALE_TMP_S:
                        f.unlink()
                    continue
                count += 1
                self.used += st.st_size
            except OSError:
                continue
        if count:
            log.info("KV offload: the disk tier starts warm with %d blocks (%.1f MiB) in %s", count, self.used / 2**20,
                     self.dir)  # fmt: skip

    def _report_others(self) -> None:
        """One line for the blocks of other models or layouts in the root: they stay, and are never loaded."""
        others, blocks = [], 0
        try:
            subdirs = [d for d in self.root.iterdir() if d.is_dir() and d != self.dir]
        except OSError:
            return
        for d in subdirs:
            try:
                meta = json.loads((d / "layout.json").read_text())
            except (OSError, ValueError):
                meta = {}
            n = sum(1 for _ in d.glob(f"*/*{SUFFIX}"))
            if n:
                blocks += n
                diff = sorted(k for k in set(meta) | set(self.layout) if meta.get(k) != self.layout.get(k))
                others.append(f"{d.name} ({', '.join(diff) or 'unreadable layout'} differ)")
        if others:
            log.warning("KV offload: %d blocks in %s belong to another model or layout and are ignored: %s", blocks,
                        self.root, "; ".join(others))  # fmt: skip

    def _files(self, include_tmp: bool = False):
        try:
            for sub in self.dir.iterdir():
                if sub.is_dir():
                    for f in sub.iterdir():
                        if f.name.endswith(SUFFIX) or (include_tmp and ".tmp." in f.name):
                            yield f
        except OSError:
            return

    # -- blocks ------------------------------------------------------------------------------------

    def path(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def __contains__(self, block_hash: int) -> bool:
        return self.path(block_hash).exists()

    def get(self, block_hash: int) -> BlockData:
        """The block's tensors, checked against its header and checksum; a bad file is deleted first."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self.file_bytes:
                    raise self._bad(path, f"{size} bytes where a block file has {self.file_bytes}")
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                    magic, version, layout_id, h, nbytes, checksum = HEADER.unpack_from(mm, 0)
                    if magic != MAGIC or version != FORMAT_VERSION or layout_id != self.layout_id:
                        raise self._bad(path, "not a block file of this layout")
                    if h != block_hash or nbytes != self.payload:
                        raise self._bad(path, "its header names another block")
                    view = memoryview(mm)[HEADER.size :]
                    if xxhash.xxh3_64_intdigest(view) != checksum:
                        view.release()
                        raise self._bad(path, "checksum mismatch")
                    out, offset = [], HEADER.size
                    for shape, dtype, n in zip(self.shapes, self.dtypes, self.sizes):
                        raw = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=offset)
                        out.append(raw.clone().view(dtype).reshape(shape))
                        offset += n
                    del raw
                    view.release()
        except FileNotFoundError:
            raise BlockFileError(f"{path.name} is gone") from None
        except OSError as e:
            raise BlockFileError(f"{path.name}: {e.strerror or e}") from None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used goes first
        return tuple(out)

    def _bad(self, path: Path, why: str) -> BlockFileError:
        with contextlib.suppress(OSError):
            path.unlink()
        return BlockFileError(f"{path.name}: {why}; dropped")

    def put(self, block_hash: int, data: BlockData) -> bool:
        """Write a block unless its file exists (another replica's, or ours); False when it did. Raises OSError."""
        path = self.path(block_hash)
        if path.exists():
            return False
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in data)
        if len(payload) != self.payload:
            raise ValueError(f"a block of {len(payload)} bytes where this layout has {self.payload}")
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.layout_id, block_hash, len(payload),
                             xxhash.xxh3_64_intdigest(payload))  # fmt: skip
        path.parent.mkdir(exist_ok=True)
        self._atomic_write(path, header + payload)
        with self.lock:
            self.used += self.file_bytes
        if self.used > self.capacity:
            self.evict()
        return True

    @staticmethod
    def _atomic_write(path: Path, data: bytes) -> None:
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def evict(self) -> int:
        """Delete the least recently used files (every replica's) until the directory is under 90% of its cap;
        returns how many went."""
        files = []
        for f in self._files():
            try:
                st = f.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, f))
        total = sum(s for _, s, _ in files)
        files.sort()
        gone = 0
        for _, size, f in files:
            if total <= 0.9 * self.capacity:
                break
            try:
                f.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    break
                continue
            total -= size
            gone += 1
        with self.lock:
            self.used = total
        return gone
