"""The engine core's side of the offload tiers (`KVOffload`): what leaves the pool, what comes back, in the core's
thread; the disk's reads and writes on threads of their own.

Store: a block registered in the prefix cache is copied out when the last request holding it lets go (it is complete:
no request writes it any more), once: to host memory and, through the writer thread, to disk. Copies happen in the
core's thread just before anything writes the pool (`flush`: before each step's launch and before a load or a pull
writes blocks), so a freed block that the next step reuses is copied before it is overwritten; on a GPU the copy is
ordered after the steps already queued. Storing at release rather than at eviction costs one copy per block either
way, and keeps a block that is still in the pool when the server stops on disk for the next start.

Load: a new request's prefix is looked up in the pool, then block by block in host memory and on disk. When part of it
is on disk, those blocks are read and checked on the loader thread while other requests' steps run, and the request
waits here until they are in host memory (`add`, `poll`). At its admission the scheduler asks for what lies below its
pool hits (`load_below`): the blocks are copied into free blocks of the pool, registered, and counted as prefix hits,
so the request computes only the rest. Nothing is reserved for a request before its admission, so a burst of hits
never fills the pool with blocks nobody runs yet. A file that is missing or fails its checksum ends the hit there:
the rest is recomputed."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from fulcrum.engine.kv_cache import Block, KVCacheManager
from fulcrum.engine.kv_layout import cache_layout, free_bytes, model_fingerprint
from fulcrum.engine.kv_offload.tiers import BlockData, BlockFileError, DiskTier, HostTier, data_nbytes
from fulcrum.engine.request import Request, RequestStatus
from fulcrum.errors import InvalidRequestError

log = logging.getLogger(__name__)

TIERS = ("ram", "disk")
# seconds; the upper bounds of the load/store latency histograms (kv_tier_latency)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_WRITE_BACKLOG = 256 * 2**20  # bytes queued for disk beyond which new blocks are not written (counted)


@dataclass
class LoadJob:
    """Disk reads for a request, in prefix order; the loader thread fills `data` up to the first block it cannot use."""

    req: Request
    hashes: list[int]
    data: list[BlockData] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    cancelled: bool = False


class Latency:
    """One histogram's counts per bucket (the last: above every bound) and the sum of observations in microseconds;
    plain ints, so that data-parallel cores' stats add up (core_client.total_stats)."""

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum_us = 0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        self.counts[i] += 1
        self.sum_us += int(seconds * 1e6)

    def encode(self) -> list[int]:
        return [*self.counts, self.sum_us]


class KVOffload:
    def __init__(self, kv: KVCacheManager, runner, config, model_config):
        if not kv.enable_prefix_caching:
            raise InvalidRequestError("KV offload needs prefix caching (offloaded blocks come back as prefix hits)",
                                      "kv_offload_dir")  # fmt: skip
        self.kv = kv
        kv.unstored = {}  # the cache manager notes the registered blocks it frees, for `flush`
        self.caches, layout = cache_layout(runner)
        self.device = runner.kv_cache.device
        # a GPU's copies go as one gather/scatter per cache tensor (and one transfer); the host's block by block
        self.batched_copies = self.device.type != "cpu"
        self.ram = None
        if config.kv_offloading_size:
            self.ram = HostTier(int(config.kv_offloading_size * 2**30), pin=self.device.type == "cuda")
        self.disk = None
        if config.kv_offload_dir:
            layout = {
                "model": model_fingerprint(model_config.path),
                "dtype": str(model_config.dtype).removeprefix("torch."),
                "kv_dtype": runner.kv_cache_dtype_name,
                "block_size": kv.block_size,
                "quantization": model_config.quantization,
                **layout,
            }
            shapes = [tuple(c.select(a, 0).shape) for c, a in self.caches]
            dtypes = [c.dtype for c, _ in self.caches]
            cap = int(config.kv_offload_dir_size * 2**30)
            self.disk = DiskTier(config.kv_offload_dir, cap, layout, shapes, dtypes)
            room = free_bytes(self.disk.root) if self.disk.writable else cap
            if room < cap - self.disk.used:  # the least recently used make room before the filesystem fills
                self.disk.capacity = self.disk.used + int(0.9 * room)
                log.warning("KV offload: %s has %.1f GiB free, under the disk tier's cap of %.1f GiB: the tier "
                            "keeps to %.1f GiB", self.disk.root, room / 2**30, cap / 2**30,
                            self.disk.capacity / 2**30)  # fmt: skip
        self.pending: dict[str, LoadJob] = {}  # request id -> its disk load
        self.staged: dict[str, dict[int, BlockData]] = {}  # read from disk for a request, until its admission
        self.results: queue.SimpleQueue[LoadJob] = queue.SimpleQueue()
        self.loads: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self.writes: queue.SimpleQueue[tuple[int, BlockData] | None] = queue.SimpleQueue()
        self.finished = threading.Event()  # set when a load result is ready
        self.lock = threading.Lock()  # the counters the threads update
        self.backlog = 0  # bytes queued for the writer
        self.counts = {f"{t}_{k}": 0 for t in TIERS for k in ("hit_blocks", "hit_bytes", "stored_blocks",
                                                               "stored_bytes", "errors", "hit_tokens")}  # fmt: skip
        self.counts.update(ram_dropped_blocks=0, disk_dropped_blocks=0, disk_corrupt_blocks=0)
        self.latency = {f"{op}:{t}": Latency() for op in ("load", "store") for t in TIERS}
        self._write_errors: set[str] = set()  # kinds already logged
        self.threads = []
        if self.disk is not None:
            for target, name in ((self._load_loop, "kv-offload-load"), (self._write_loop, "kv-offload-write")):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self.threads.append(t)
        tiers = [f"host memory {config.kv_offloading_size:g} GiB"] if self.ram is not None else []
        if self.disk is not None:
            tiers.append(f"disk {self.disk.dir} (cap {config.kv_offload_dir_size:g} GiB)")
        log.info("KV offload tiers: %s", ", ".join(tiers))

    # -- store ----------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Copy out the registered blocks freed since the last call that a tier lacks; call before anything writes
        the pool."""
        freed = self.kv.take_unstored()
        if not freed:
            return
        t0 = time.perf_counter()
        todo = []
        for block_id, h in freed.items():
            to_ram = self.ram is not None and h not in self.ram
            to_disk = self.disk is not None and self.disk.writable and h not in self.disk
            if to_ram or to_disk:
                todo.append((block_id, h, to_ram, to_disk))
            self._mark_stored(block_id, h)
        if not todo:
            return
        data = self._read_blocks([b for b, *_ in todo])
        for (_, h, to_ram, to_disk), d in zip(todo, data):
            nbytes = data_nbytes(d)
            if to_ram:
                self.ram.put(h, d)
                self._count("ram_stored", nbytes)
            if to_disk:
                if self.backlog + nbytes > MAX_WRITE_BACKLOG:
                    with self.lock:
                        self.counts["disk_dropped_blocks"] += 1
                    continue
                with self.lock:
                    self.backlog += nbytes
                self.writes.put((h, d))
        if self.ram is not None:
            self.latency["store:ram"].observe(time.perf_counter() - t0)

    def _mark_stored(self, block_id: int, h: int) -> None:
        b = self.kv.blocks[block_id]
        if b.block_hash == h:
            b.stored = True

    def _read_blocks(self, block_ids: list[int]) -> list[BlockData]:
        """Copies of pool blocks on the host, one contiguous tensor per cache tensor each."""
        per_cache = []
        for cache, axis in self.caches:
            if not self.batched_copies:
                views = [cache.select(axis, b) for b in block_ids]
                per_cache.append([torch.empty(v.shape, dtype=v.dtype).copy_(v) for v in views])
            else:
                idx = torch.tensor(block_ids, device=self.device)
                rows = cache.index_select(axis, idx).movedim(axis, 0).contiguous().cpu()
                per_cache.append([r.clone() for r in rows.unbind(0)])  # each its own storage: tiers count bytes
        return [tuple(c[i] for c in per_cache) for i in range(len(block_ids))]

    def _write_blocks(self, block_ids: list[int], data: list[BlockData]) -> None:
        """Copy blocks into the pool (core thread)."""
        self.flush()
        for k, (cache, axis) in enumerate(self.caches):
            if not self.batched_copies:
                for b, d in zip(block_ids, data):
                    cache.select(axis, b).copy_(d[k])
            else:
                rows = torch.stack([d[k] for d in data]).to(self.device, non_blocking=True)
                cache.index_copy_(axis, torch.tensor(block_ids, device=self.device), rows.movedim(0, axis))

    def _write_loop(self) -> None:
        while (item := self.writes.get()) is not None:
            h, d = item
            nbytes = data_nbytes(d)
            t0 = time.perf_counter()
            try:
                wrote = self.disk.put(h, d)
            except OSError as e:
                wrote = False
                self._write_failed(e)
            finally:
                with self.lock:
                    self.backlog -= nbytes
            if wrote:
                self.latency["store:disk"].observe(time.perf_counter() - t0)
                self._count("disk_stored", nbytes)

    def _write_failed(self, e: OSError) -> None:
        with self.lock:
            self.counts["disk_errors"] += 1
        kind = e.strerror or type(e).__name__
        if kind not in self._write_errors:  # once per kind: a full disk would say so for every block
            self._write_errors.add(kind)
            log.warning("KV offload: writing a block to %s failed (%s); blocks that cannot be stored are recomputed "
                        "when they come back", self.disk.dir, kind)  # fmt: skip

    def _count(self, what: str, nbytes: int, blocks: int = 1) -> None:
        tier, kind = what.split("_", 1)
        with self.lock:
            self.counts[f"{tier}_{kind}_blocks"] += blocks
            self.counts[f"{tier}_{kind}_bytes"] += nbytes

    # -- load -----------------------------------------------------------------------------------------

    def _below(self, req: Request, start: int):
        """The request's prompt blocks from `start` on that the tiers hold in a row: (hash, staged data, tier) with
        staged data for blocks read from disk for it, host memory's for the rest (None where still on disk)."""
        staged = self.staged.get(req.request_id, {})
        for h in self.kv.prompt_hashes(req)[start:]:
            if h in staged:
                yield h, staged[h], "disk"
            elif self.ram is not None and (d := self.ram.get(h)) is not None:
                yield h, d, "ram"
            elif self.disk is not None and h in self.disk:
                yield h, None, "disk"
            else:
                return

    def found_below(self, req: Request, start: int) -> int:
        """How many of the request's full prompt blocks from `start` on the tiers hold in a row (for P/D: a consumer
        that finds them here pulls nothing)."""
        return sum(1 for _ in self._below(req, start))

    def add(self, req: Request) -> bool:
        """A new request: when its prefix goes on below the pool and part of it is on disk, those blocks are read
        and checked on the loader thread while other steps run, and it waits here (True; `poll` gives it back).
        Otherwise it goes to the scheduler now (False). Either way the blocks reach the pool at its admission."""
        if req.wants_prompt_logprobs:
            return False
        computed, _ = self.kv.get_computed_blocks(req)
        found = list(self._below(req, len(computed)))
        if not any(d is None for _, d, _ in found):
            return False
        job = LoadJob(req, [h for h, d, _ in found if d is None])
        self.pending[req.request_id] = job
        self.loads.put(job)
        return True

    def _load_loop(self) -> None:
        while (job := self.loads.get()) is not None:
            t0 = time.perf_counter()
            for h in job.hashes:
                if job.cancelled:
                    break
                try:
                    job.data.append(self.disk.get(h))
                except BlockFileError as e:
                    job.error = str(e)
                    break
            job.seconds = time.perf_counter() - t0
            self.results.put(job)
            self.finished.set()

    def poll(self) -> list[Request]:
        """Disk reads that ended: their requests, for the scheduler (with what was read staged for their
        admission, and promoted to host memory)."""
        ready = []
        self.finished.clear()
        while True:
            try:
                job = self.results.get_nowait()
            except queue.Empty:
                break
            rid = job.req.request_id
            self.pending.pop(rid, None)
            if job.cancelled:
                self.kv.release(rid)  # the hashes its prefix lookup left
                continue
            if job.error:
                with self.lock:
                    self.counts["disk_corrupt_blocks" if "dropped" in job.error else "disk_errors"] += 1
                log.warning("request %s: KV offload: %s; the rest of its prefix is recomputed", rid, job.error)
            self.latency["load:disk"].observe(job.seconds)
            self.staged[rid] = dict(zip(job.hashes, job.data))
            if self.ram is not None:
                for h, d in self.staged[rid].items():
                    self.ram.put(h, d)  # promoted: the next hit is a copy, not a read
            ready.append(job.req)
        return ready

    def load_below(self, req: Request, computed: list[Block]) -> list[Block]:
        """The scheduler's admission hook: the request's prefix after its pool hits `computed`, as far as host
        memory (or what was read from disk for it) holds it, copied into free blocks and registered; returns the
        longer list of hit blocks (unchanged when nothing is found or there is no room)."""
        staged = self.staged.pop(req.request_id, None)
        if req.wants_prompt_logprobs:
            return computed
        if staged:
            self.staged[req.request_id] = staged  # for _below
        found = []
        for h, d, tier in self._below(req, len(computed)):
            if d is None:
                break  # on disk, not read for it (it was not there at arrival): recomputed
            found.append((h, d, tier))
        self.staged.pop(req.request_id, None)
        if not found:
            return computed
        t0 = time.perf_counter()
        bs, have, n = self.kv.block_size, len(computed), len(computed) + len(found)
        # a resumed (preempted) request's prefix runs into its output: the stand-in holds all its known tokens
        stand_in = Request(f"{req.request_id}#tier", list(req.all_token_ids[: n * bs]), req.sampling_params)
        if not self.kv.allocate_slots(stand_in, len(found) * bs, computed, register=False):
            return computed
        blocks = list(self.kv.req_blocks[stand_in.request_id])
        self._write_blocks([b.block_id for b in blocks[have:]], [d for _, d, _ in found])
        self.kv.cache_blocks(stand_in, n * bs)
        for b, (_, d, tier) in zip(blocks[have:], found):
            b.stored = True
            self._count(f"{tier}_hit", data_nbytes(d))
            with self.lock:
                self.counts[f"{tier}_hit_tokens"] += bs
        self.kv.free(stand_in)  # the blocks wait in the free queue; the scheduler's allocation takes them back
        tiers = {t for *_, t in found}
        self.latency["load:ram" if tiers == {"ram"} else "load:disk"].observe(time.perf_counter() - t0)
        return blocks

    def abort(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests still waiting for their reads (the reads stop at the next block)."""
        done = []
        for rid in request_ids:
            job = self.pending.get(rid)
            if job is not None and not job.cancelled:
                job.cancelled = True
                job.req.status = status
                done.append(job.req)
        return done

    def after_schedule(self, requests: dict[str, Request]) -> None:
        """Drop what was staged for requests that ended before their admission."""
        for rid in [r for r in self.staged if r not in requests]:
            del self.staged[rid]

    def busy(self) -> bool:
        return bool(self.pending)

    def requests(self) -> list[Request]:
        """The requests waiting for their disk reads."""
        return [job.req for job in self.pending.values()]

    def wait(self, timeout: float) -> None:
        self.finished.wait(timeout)

    # -- the rest -------------------------------------------------------------------------------------

    def stats(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Cumulative counts (and the tiers' occupancy and capacity, gauges) and latency histograms."""
        with self.lock:
            counts = dict(self.counts)
        for tier in (self.ram, self.disk):
            if tier is not None:
                counts[f"{tier.name}_used_bytes"] = tier.used
                counts[f"{tier.name}_capacity_bytes"] = tier.capacity
        counts["loading_requests"] = len(self.pending)
        return counts, {k: v.encode() for k, v in self.latency.items()}

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued disk writes (up to `timeout` seconds) and stop the threads."""
        self.flush()
        self.loads.put(None)
        self.writes.put(None)
        for t in self.threads:
            t.join(timeout)
