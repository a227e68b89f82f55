"""Routing policies: each picks one replica for a request among those available and says why (the reason is
counted in the router's /metrics). Prefix-aware policies see the request's chained block hashes at each
replica's block size (the engine's own hash, fulcrum/utils/hashing.py)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from fulcrum.router.kv_index import KVIndex
from fulcrum.router.pool import SATURATED, Pool, Replica

DEFAULT_BLOCK_SIZE = 16  # a replica that does not publish cache_config_info (SGLang) is hashed at this size


@dataclass
class Decision:
    replica: Replica
    reason: str  # round-robin, least-load, prefix, kv-events, load-guard, no-prefix, weighted, sticky
    cached_blocks: int = 0
    prompt_blocks: int = 0


def blocks_of(r: Replica, hashes: Callable[[int], list[int]]) -> list[int]:
    return hashes(r.metrics.block_size or DEFAULT_BLOCK_SIZE)


class RoundRobin:
    name = "round-robin"

    def __init__(self, pool: Pool):
        self.pool, self._counter = pool, itertools.count()

    def choose(self, candidates: list[Replica], hashes) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)], "round-robin")


class LeastLoad:
    name = "least-load"

    def __init__(self, pool: Pool):
        self.pool = pool

    def choose(self, candidates: list[Replica], hashes) -> Decision:
        return Decision(self.pool.least_loaded(candidates), "least-load")


class Prefix:
    """The longest cached prefix wins unless that replica's load exceeds the least-loaded one's by more than
    `balance_margin` (requests in flight plus queued): then the least-loaded takes it (the balance guard).
    Approximate: a replica's cache is guessed from the prompts the router sent it."""

    name = "prefix"
    reason = "prefix"

    def __init__(self, pool: Pool, balance_margin: float = 4.0):
        self.pool, self.balance_margin = pool, balance_margin

    def blocks(self, r: Replica, hashes) -> list[int]:
        return blocks_of(r, hashes)

    def matched(self, r: Replica, hashes) -> int:
        return r.cached_prefix(self.blocks(r, hashes))

    def choose(self, candidates: list[Replica], hashes) -> Decision:
        matched = [(r, self.matched(r, hashes)) for r in candidates]
        best = max(n for _, n in matched)
        least = self.pool.least_loaded(candidates)
        if best == 0:
            return Decision(least, "no-prefix", 0, len(self.blocks(least, hashes)))
        choice = random.choice([r for r, n in matched if n == best])
        low, mine = least.load(self.pool.stale_after), choice.load(self.pool.stale_after)
        if mine == SATURATED and low < SATURATED or mine - low > self.balance_margin:
            return Decision(least, "load-guard", self.matched(least, hashes), len(self.blocks(least, hashes)))
        # blocks counted at the chosen replica's block size, so the router's hit-rate estimate is in its units
        return Decision(choice, self.reason, best, len(self.blocks(choice, hashes)))


class KVEvents(Prefix):
    """Prefix routing on what each replica's cache holds, from its KV-cache events (router/kv_index.py), hashed
    at the block size its events carry; the same balance guard."""

    name = "kv-events"
    reason = "kv-events"

    def __init__(self, pool: Pool, index: KVIndex, balance_margin: float = 4.0):
        super().__init__(pool, balance_margin)
        self.index = index

    def blocks(self, r: Replica, hashes) -> list[int]:
        return hashes(self.index.of(r.url).block_size or r.metrics.block_size or DEFAULT_BLOCK_SIZE)

    def matched(self, r: Replica, hashes) -> int:
        return self.index.cached_prefix(r.url, self.blocks(r, hashes))


class Weighted:
    """score = prefix_weight * (cached fraction of the prompt) - load_weight * load; the highest wins. The cached
    fraction comes from the replicas' KV-cache events when the router subscribes to them, else from the prompts
    it sent them."""

    name = "weighted"

    def __init__(self, pool: Pool, prefix_weight: float = 1.0, load_weight: float = 0.1, index: KVIndex | None = None):
        self.pool, self.prefix_weight, self.load_weight = pool, prefix_weight, load_weight
        self.index = index

    def choose(self, candidates: list[Replica], hashes) -> Decision:
        scored = []
        for r in candidates:
            if self.index is not None:
                blocks = hashes(self.index.of(r.url).block_size or r.metrics.block_size or DEFAULT_BLOCK_SIZE)
                cached = self.index.cached_prefix(r.url, blocks)
            else:
                blocks = blocks_of(r, hashes)
                cached = r.cached_prefix(blocks)
            load = min(r.load(self.pool.stale_after), 1e6)
            score = self.prefix_weight * (cached / len(blocks) if blocks else 0.0) - self.load_weight * load
            scored.append((score, r, cached, len(blocks)))
        top = max(s for s, *_ in scored)
        _, r, cached, total = random.choice([x for x in scored if x[0] == top])
        return Decision(r, "weighted", cached, total)


POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, Prefix, KVEvents, Weighted)}
NEEDS_TOKENS = {"prefix", "kv-events", "weighted"}
