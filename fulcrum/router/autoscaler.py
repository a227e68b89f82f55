"""The SLO-driven autoscaler: Knative's scheme over the router's pool. Concurrency (requests in flight and
queued) averaged over a stable window sets the replica count; a panic window reacts to a burst and, while it
lasts, never scales down. A measured TTFT or ITL percentile over the SLO, or the replicas' KV caches nearly full,
adds a replica; a replica is removed
only when N-1 would hold the load, and it drains (no new requests, those in flight finish) before it stops."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from fulcrum.router.pool import Pool
from fulcrum.router.scrape import Histogram, add

log = logging.getLogger("fulcrum.autoscale")


@dataclass
class SLO:
    ttft: float | None = None  # seconds
    itl: float | None = None
    percentile: float = 0.9


def _seconds(text: str) -> float:
    text = text.strip()
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    return float(text.removesuffix("s"))


def parse_slo(text: str, percentile: float = 0.9) -> SLO:
    """ "ttft=500ms,itl=0.1" (seconds unless ms)."""
    slo = SLO(percentile=percentile)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in ("ttft", "itl") or not value:
            raise ValueError(f"--slo takes ttft=SECONDS,itl=SECONDS, not {part!r}")
        setattr(slo, key, _seconds(value))
    return slo


@dataclass
class ScalerConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    target_concurrency: float = 4.0  # requests in flight per replica the pool is sized for
    stable_window: float = 60.0
    panic_window: float = 6.0
    panic_threshold: float = 2.0  # panic when the panic window wants this many times the replicas there are
    tick: float = 1.0
    drain_timeout: float = 60.0
    slo: SLO = field(default_factory=SLO)
    # the replicas' mean KV-cache usage over the panic window above this adds one (a full cache preempts and
    # queues before concurrency or latency show it); a scale-down must leave N-1 under it
    kv_usage_limit: float = 0.9


@dataclass
class Event:
    at: float
    kind: str  # up, down
    replicas: int  # after
    reason: str


class Decider:
    """Pure: samples in, a replica count out (time is given, so that tests drive a clock)."""

    def __init__(self, cfg: ScalerConfig):
        self.cfg = cfg
        self.samples: deque[tuple[float, float]] = deque()  # (time, concurrency)
        self.latency: deque[tuple[float, Histogram, Histogram]] = deque()  # (time, ttft delta, itl delta)
        self.kv_usage: deque[tuple[float, float]] = deque()  # (time, mean KV-cache usage of the replicas)
        self.panic_until = -math.inf

    def observe(self, now: float, concurrency: float, ttft: Histogram | None = None, itl: Histogram | None = None,
                kv_usage: float | None = None):  # fmt: skip
        self.samples.append((now, concurrency))
        if kv_usage is not None:
            self.kv_usage.append((now, kv_usage))
        while self.kv_usage and self.kv_usage[0][0] <= now - self.cfg.panic_window:
            self.kv_usage.popleft()
        self.latency.append((now, ttft or Histogram(), itl or Histogram()))
        while self.samples and self.samples[0][0] < now - self.cfg.stable_window:
            self.samples.popleft()
        while self.latency and self.latency[0][0] < now - self.cfg.stable_window:
            self.latency.popleft()

    def _average(self, now: float, window: float) -> float:
        xs = [c for t, c in self.samples if t > now - window]
        return sum(xs) / len(xs) if xs else 0.0

    def percentiles(self) -> tuple[float | None, float | None]:
        ttft, itl = Histogram(), Histogram()
        for _, t, i in self.latency:
            ttft, itl = add(ttft, t), add(itl, i)
        q = self.cfg.slo.percentile
        return ttft.quantile(q), itl.quantile(q)

    def slo_violated(self) -> str | None:
        ttft, itl = self.percentiles()
        slo = self.cfg.slo
        if slo.ttft is not None and ttft is not None and ttft > slo.ttft:
            return f"ttft p{slo.percentile * 100:g} {ttft:.3f} s > {slo.ttft:g} s"
        if slo.itl is not None and itl is not None and itl > slo.itl:
            return f"itl p{slo.percentile * 100:g} {itl:.3f} s > {slo.itl:g} s"
        return None

    def desired(self, now: float, current: int) -> tuple[int, str]:
        cfg, target = self.cfg, self.cfg.target_concurrency
        stable = self._average(now, cfg.stable_window)
        panic = self._average(now, cfg.panic_window)
        want_stable, want_panic = math.ceil(stable / target), math.ceil(panic / target)
        if current and want_panic / current >= cfg.panic_threshold:
            self.panic_until = now + cfg.stable_window
        if now < self.panic_until:
            n, reason = max(current, want_panic), f"panic: concurrency {panic:.1f} over {cfg.panic_window:g} s"
        else:
            n, reason = want_stable, f"concurrency {stable:.1f} over {cfg.stable_window:g} s"
        violated = self.slo_violated()
        usage = sum(u for _, u in self.kv_usage) / len(self.kv_usage) if self.kv_usage else 0.0
        if usage > cfg.kv_usage_limit and not violated:
            violated = f"KV cache usage {usage:.2f} > {cfg.kv_usage_limit:g} over {cfg.panic_window:g} s"
        if violated and n <= current:
            n, reason = current + 1, violated
        if n < current:
            # one at a time, and only when N-1 would hold the load: at most the target each, the SLO met, and
            # their KV caches under the limit with this one's share spread over them
            if (violated or current - 1 <= 0 or stable / (current - 1) > target
                    or usage * current / (current - 1) > cfg.kv_usage_limit):  # fmt: skip
                n, reason = current, "N-1 would not hold the load"
            else:
                n = current - 1
        return max(cfg.min_replicas, min(cfg.max_replicas, n)), reason


class Autoscaler:
    """Runs the Decider every tick over the router's pool and starts or drains replicas through a backend."""

    def __init__(self, pool: Pool, backend, cfg: ScalerConfig):
        self.pool, self.backend, self.cfg = pool, backend, cfg
        self.decider = Decider(cfg)
        self.events: list[Event] = []
        self.owned: list[str] = []  # replicas this autoscaler started, oldest first
        self.starting = 0
        self._last_hist: dict[str, tuple[Histogram, Histogram]] = {}
        self._busy: asyncio.Task | None = None

    def concurrency(self) -> float:
        """Requests in flight and queued. The router's own count is exact for what it sent; a replica's gauges add
        traffic from elsewhere, but its running gauge keeps the last step's value when it goes idle, so it counts
        only while the router has requests there."""
        total = 0.0
        for r in self.pool.replicas.values():
            seen = r.metrics.running + r.metrics.waiting if r.in_flight else r.metrics.waiting
            total += max(r.in_flight, seen)
        return total

    def kv_usage(self) -> float | None:
        """The mean KV-cache usage of the replicas in the pool (None before any answered)."""
        seen = [r.metrics.kv_usage for r in self.pool.available() if r.scraped_at]
        return sum(seen) / len(seen) if seen else None

    def _latency_deltas(self) -> tuple[Histogram, Histogram]:
        ttft, itl = Histogram(), Histogram()
        for url, r in self.pool.replicas.items():
            old = self._last_hist.get(url)
            if old is not None:
                ttft, itl = add(ttft, r.metrics.ttft.minus(old[0])), add(itl, r.metrics.itl.minus(old[1]))
            self._last_hist[url] = (r.metrics.ttft, r.metrics.itl)
        return ttft, itl

    async def run(self) -> None:
        while len(self.owned) < self.cfg.min_replicas:
            await self._scale_up(f"--min {self.cfg.min_replicas}")
        while True:
            await asyncio.sleep(self.cfg.tick)
            now = time.monotonic()
            self.decider.observe(now, self.concurrency(), *self._latency_deltas(), kv_usage=self.kv_usage())
            if self._busy is not None and not self._busy.done():
                continue  # one scale event at a time: a starting replica counts once it is up
            current = len(self.owned)
            n, reason = self.decider.desired(now, current)
            if n > current:
                self._busy = asyncio.get_running_loop().create_task(self._scale_up(reason))
            elif n < current:
                self._busy = asyncio.get_running_loop().create_task(self._scale_down(reason))

    async def _scale_up(self, reason: str) -> None:
        log.info("scaling up to %d: %s", len(self.owned) + 1, reason)
        url = await asyncio.to_thread(self.backend.start)
        self.owned.append(url)
        r = self.pool.add(url)
        await self.pool.check(r)
        self.events.append(Event(time.monotonic(), "up", len(self.owned), reason))

    async def _scale_down(self, reason: str) -> None:
        # the replica with the least in flight drains: the router sends it nothing new
        r = min((self.pool.replicas[u] for u in self.owned if u in self.pool.replicas), key=lambda r: r.in_flight)
        log.info("scaling down to %d: draining %s (%s)", len(self.owned) - 1, r.url, reason)
        r.draining = True
        deadline = time.monotonic() + self.cfg.drain_timeout
        while r.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.owned.remove(r.url)
        self.pool.remove(r.url)
        await asyncio.to_thread(self.backend.stop, r.url)  # SIGTERM: the replica drains what is left itself
        self.events.append(Event(time.monotonic(), "down", len(self.owned), reason))

    def close(self) -> None:
        for url in list(self.owned):
            self.backend.stop(url)
        self.owned.clear()
