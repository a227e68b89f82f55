"""The router's own /metrics: requests and retries per replica, decisions by reason, the prefix hit estimate
(blocks the router believed cached over blocks routed), and each replica's health, in-flight count and load;
with KV-cache events, the blocks the index holds per replica, the stored blocks it left out and how often a
replica's entries were dropped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from fulcrum.router.kv_index import KVIndex
from fulcrum.router.policies import Decision
from fulcrum.router.pool import SATURATED, Pool, Replica


class RouterMetrics:
    def __init__(self, pool: Pool, kv_index: KVIndex | None = None):
        self.pool, self.kv_index = pool, kv_index
        self.registry = r = CollectorRegistry()
        self.requests = Counter("fulcrum_router:requests", "Requests sent to a replica", ["replica"], registry=r)
        self.served_total = Counter("fulcrum_router:served", "Requests a replica answered", ["replica"], registry=r)
        self.retries = Counter(
            "fulcrum_router:retries", "Requests a replica failed before the first token (retried elsewhere)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.failed_total = Counter(
            "fulcrum_router:failed", "Requests that ended with an error", ["replica"], registry=r
        )
        self.decisions = Counter("fulcrum_router:decisions", "Routing decisions", ["reason"], registry=r)
        self.prefix_blocks = Counter("fulcrum_router:prefix_query_blocks", "Prompt blocks routed", registry=r)
        self.prefix_hits = Counter("fulcrum_router:prefix_hit_blocks", "Prompt blocks believed cached", registry=r)
        self.hit_rate = Gauge("fulcrum_router:prefix_hit_rate", "Estimated prefix cache hit rate", registry=r)
        self.healthy = Gauge("fulcrum_router:replica_healthy", "1 when in the pool", ["replica"], registry=r)
        self.in_flight = Gauge("fulcrum_router:replica_in_flight", "Requests in flight", ["replica"], registry=r)
        self.load = Gauge(
            "fulcrum_router:replica_load", "Load as policies see it (-1: saturated)", ["replica"], registry=r
        )
        self.replicas = Gauge("fulcrum_router:replicas", "Replicas available", registry=r)
        self.kv_blocks = Gauge(
            "fulcrum_router:kv_index_blocks",
            "Block hashes a replica holds, from its KV events",
            ["replica"],
            registry=r,
        )
        self.kv_skipped = Gauge(
            "fulcrum_router:kv_index_skipped_blocks",
            "Stored blocks left out of the index: unplaced (parent unknown), unmatchable (LoRA, multimodal, salt)",
            ["replica", "reason"], registry=r,
        )  # fmt: skip
        self.kv_drops = Gauge(
            "fulcrum_router:kv_index_drops", "Times a replica's entries were dropped (restart, gap, failure)",
            ["replica"], registry=r,
        )  # fmt: skip

    def decided(self, d: Decision, retry: bool) -> None:
        self.requests.labels(d.replica.url).inc()
        self.decisions.labels("retry-" + d.reason if retry else d.reason).inc()
        if d.prompt_blocks:
            self.prefix_blocks.inc(d.prompt_blocks)
            self.prefix_hits.inc(d.cached_blocks)

    def retried(self, r: Replica) -> None:
        self.retries.labels(r.url).inc()

    def served(self, r: Replica) -> None:
        self.served_total.labels(r.url).inc()

    def failed(self, r: Replica | None = None) -> None:
        self.failed_total.labels(r.url if r else "none").inc()

    def collect(self) -> CollectorRegistry:
        queried = self.prefix_blocks._value.get()
        self.hit_rate.set(self.prefix_hits._value.get() / queried if queried else 0.0)
        for r in self.pool.replicas.values():
            self.healthy.labels(r.url).set(1 if r.available else 0)
            self.in_flight.labels(r.url).set(r.in_flight)
            load = r.load(self.pool.stale_after)
            self.load.labels(r.url).set(-1 if load == SATURATED else load)
        self.replicas.set(len(self.pool.available()))
        if self.kv_index is not None:
            for url, held in list(self.kv_index.replicas.items()):
                self.kv_blocks.labels(url).set(len(held.held))
                self.kv_drops.labels(url).set(held.drops)
                self.kv_skipped.labels(url, "unplaced").set(held.unplaced)
                self.kv_skipped.labels(url, "unmatchable").set(held.unmatchable)
        return self.registry
