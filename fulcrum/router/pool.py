"""The replicas behind the router: what each was last seen to hold (scraped /metrics, health), what the router
itself has in flight on it, and which prompt blocks it was sent. A replica that fails leaves the rotation and
returns when its /health answers 200 again; one whose scrape is stale counts as saturated."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp

from fulcrum.router.scrape import ReplicaMetrics, parse_metrics

log = logging.getLogger("fulcrum.router")
SATURATED = float("inf")
DEFAULT_TRACKED_BLOCKS = 100_000  # per replica, when its /metrics does not say how many blocks it holds


@dataclass
class Replica:
    url: str
    healthy: bool = False
    draining: bool = False  # no new requests (a scale-down in progress)
    in_flight: int = 0  # requests this router has sent and not yet seen end
    metrics: ReplicaMetrics = field(default_factory=ReplicaMetrics)
    scraped_at: float = 0.0  # monotonic time of the last good /metrics
    failures: int = 0  # consecutive failed checks
    blocks: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, least recently sent first

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    def load(self, stale_after: float, now: float | None = None) -> float:
        """Requests in flight at dispatch plus the replica's own queue; saturated when the scrape is stale or the
        KV cache is full."""
        now = time.monotonic() if now is None else now
        if now - self.scraped_at > stale_after or self.metrics.kv_usage >= 0.99:
            return SATURATED
        return self.in_flight + self.metrics.waiting + self.metrics.kv_usage

    def cached_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt this replica was sent before (an estimate of its prefix cache)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        capacity = self.metrics.num_blocks or DEFAULT_TRACKED_BLOCKS
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > capacity:
            self.blocks.popitem(last=False)


class Pool:
    def __init__(self, urls: list[str], interval: float = 0.25, stale_after: float = 2.0, timeout: float = 1.0):
        self.replicas: dict[str, Replica] = {}
        self.interval, self.stale_after, self.timeout = interval, stale_after, timeout
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self.on_scrape = []  # callbacks(replica) after each good scrape (the autoscaler samples there)
        self.on_add, self.on_remove, self.on_failed = [], [], []  # callbacks(replica), (url), (replica)
        for url in urls:
            self.replicas[url.rstrip("/")] = Replica(url.rstrip("/"))

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout), trust_env=False)
        for r in list(self.replicas.values()):
            self._watch(r)
        # the first checks before taking traffic, so that a router started beside healthy replicas routes at once
        await asyncio.gather(*(self.check(r) for r in self.replicas.values()))

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._session:
            await self._session.close()

    def _watch(self, r: Replica) -> None:
        self._tasks[r.url] = asyncio.get_running_loop().create_task(self._loop(r))

    def add(self, url: str) -> Replica:
        url = url.rstrip("/")
        new = url not in self.replicas
        r = self.replicas.setdefault(url, Replica(url))
        if url not in self._tasks and self._session is not None:
            self._watch(r)
        if new:
            for callback in self.on_add:
                callback(r)
        return r

    def remove(self, url: str) -> None:
        self.replicas.pop(url, None)
        task = self._tasks.pop(url, None)
        if task:
            task.cancel()
        for callback in self.on_remove:
            callback(url)

    def available(self, exclude: set[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas.values() if r.available and r.url not in exclude]

    def least_loaded(self, candidates: list[Replica]) -> Replica:
        loads = [r.load(self.stale_after) for r in candidates]
        low = min(loads)
        return random.choice([r for r, x in zip(candidates, loads) if x == low])

    def mark_failed(self, r: Replica) -> None:
        if r.healthy:
            log.warning("replica %s failed: out of the pool until /health answers", r.url)
            for callback in self.on_failed:
                callback(r)
        r.healthy = False
        r.failures += 1

    async def _loop(self, r: Replica) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check(r)
            except asyncio.CancelledError:
                raise
            except Exception:  # a check must never end the watch
                log.exception("checking %s", r.url)

    async def check(self, r: Replica) -> None:
        try:
            async with self._session.get(f"{r.url}/health") as resp:
                ok = resp.status == 200
            if ok:
                async with self._session.get(f"{r.url}/metrics") as resp:
                    if resp.status == 200:
                        r.metrics = parse_metrics(await resp.text())
                        r.scraped_at = time.monotonic()
        except asyncio.TimeoutError:
            # a busy replica (or a busy router host) may answer one check late: two in a row take it out
            if r.healthy and r.failures == 0:
                r.failures = 1
                return
            ok = False
        except (aiohttp.ClientError, ValueError):
            ok = False
        if ok and not r.healthy:
            log.info("replica %s is healthy: in the pool", r.url)
        if ok:
            r.failures = 0
        else:
            self.mark_failed(r)
        r.healthy = ok
        if ok:
            for callback in self.on_scrape:
                callback(r)
