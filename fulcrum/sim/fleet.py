"""The fleet: replicas behind fulcrum's router policies (and autoscaler, and P/D split), on one discrete-event clock.

Events, in time order: a client sends a request (open loop: gamma/Poisson arrivals; closed loop: a user's next
session when the last one ends; a conversation's next turn when its reply is in); the request reaches an engine
`frontend_s` later (HTTP, tokenizing, the hop between processes: measured by calibration); an engine's step ends (its
tokens are taken, its next step is scheduled at once, as the engine core's loop does); the router scrapes every
replica's gauges (every `scrape_interval`, as the router's pool does, so routing sees them as stale as it does live);
the autoscaler ticks; a P/D KV pull ends; a new replica is up.

The routing decisions are the router's own policy objects (router/policies.py) over a Pool of Replica records whose
gauges and in-flight counts the simulation keeps; the prefix policy remembers what it sent as the live router does,
and the kv-events policy reads an index fed by each simulated KV cache's own events. The autoscaler's decisions are
its Decider's (router/autoscaler.py), fed as Autoscaler feeds it: concurrency, latency histograms, KV usage."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

from fulcrum.router.app import RouterConfig, make_policy
from fulcrum.router.autoscaler import Autoscaler, ScalerConfig
from fulcrum.router.kv_index import KVIndex
from fulcrum.router.pd import PDConfig
from fulcrum.router.pool import Pool
from fulcrum.router.scrape import Histogram
from fulcrum.router.tokens import hasher
from fulcrum.server.metrics import ITL_BUCKETS, TTFT_BUCKETS
from fulcrum.sim.replica import EngineShape, SimReplica, Track
from fulcrum.sim.workload import SimSession

# event kinds, in the order ties are taken at one instant: steps end before new work arrives, as a live engine
# takes what arrived during a step at the next schedule; an idle engine wakes after everything that reaches it at
# that instant (a live one that was idle takes the whole burst in its first step too)
STEP_END, PULL_DONE, ENGINE_ARRIVE, SEND, WAKE, SCRAPE, TICK, REPLICA_UP = range(8)


@dataclass
class FleetConfig:
    replicas: int = 1
    policy: str = "round-robin"
    prefill_replicas: int = 0  # P/D: both > 0
    decode_replicas: int = 0
    autoscale: ScalerConfig | None = None
    replica_startup_s: float = 10.0  # a scale-up's replica takes this long to serve
    scrape_interval: float = 0.25  # the router pool's
    router_s: float = 0.0  # the router's own hop, added to each request's way in
    balance_margin: float = 4.0
    pd: PDConfig = field(default_factory=PDConfig)
    record_steps: bool = False  # keep each replica's step log (tests compare it with a live engine's)

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0 or self.decode_replicas > 0

    def check(self) -> None:
        if self.disaggregated and (self.prefill_replicas < 1 or self.decode_replicas < 1):
            raise ValueError("P/D needs --prefill-replicas >= 1 and --decode-replicas >= 1")
        if not self.disaggregated and self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.disaggregated and self.autoscale is not None:
            raise ValueError("--autoscale scales one pool; it does not combine with a P/D split")
        if self.replica_startup_s < 0 or self.scrape_interval <= 0 or self.router_s < 0:
            raise ValueError("--replica-startup and --router-latency must be >= 0, the scrape interval > 0")


@dataclass
class Load:
    """Open loop (`rate`, arrivals drawn from the seed) or closed loop (`concurrency` users); the run ends after
    `num_prompts` sessions or no new session after `duration` seconds."""

    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = None
    duration: float | None = None
    seed: int = 0


@dataclass
class FleetResult:
    tracks: list[Track]
    duration: float
    peak_concurrency: int
    replica_seconds: float
    replicas: dict[str, dict]  # per replica: steps, busy, prefix hits, preemptions, role
    scale_events: list[dict]
    routes: dict[str, int]  # decisions by reason
    steps_log: dict[str, list]  # with record_steps
    sim_events: int = 0


class _Stream:
    """The sessions of a run, drawn as needed."""

    def __init__(self, sessions: Iterator[SimSession], limit: int | None):
        self.it, self.left = sessions, limit

    def next(self) -> SimSession | None:
        if self.left is not None:
            if self.left <= 0:
                return None
            self.left -= 1
        return next(self.it, None)


class Fleet:
    def __init__(self, cfg: FleetConfig, shape: EngineShape, costs, frontend_s: float | None = None,
                 kv_transfer_s_per_block: float | None = None):  # fmt: skip
        cfg.check()
        self.cfg, self.shape, self.costs = cfg, shape, costs
        self.frontend_s = costs.frontend_s if frontend_s is None else frontend_s
        self.transfer_s = costs.kv_transfer_s_per_block if kv_transfer_s_per_block is None else kv_transfer_s_per_block
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self.routes: dict[str, int] = {}
        self.sims: dict[str, SimReplica] = {}  # in the pools now
        self.every: dict[str, SimReplica] = {}  # every replica the run had, retired ones too
        self.lifetimes: dict[str, list[float]] = {}  # name -> [start, end]
        rcfg = RouterConfig(policy=cfg.policy, balance_margin=cfg.balance_margin)
        self.uses_events = rcfg.uses_kv_events
        self.index = KVIndex() if self.uses_events else None
        self.remembers = rcfg.remembers_sent
        self.pools: dict[str, Pool] = {}
        self.policies: dict[str, object] = {}
        roles = {"prefill": "producer", "decode": "consumer"} if cfg.disaggregated else {"main": "both"}
        for pool_name, role in roles.items():
            pool = Pool([], stale_after=math.inf)  # gauges are as fresh as the last simulated scrape
            self.pools[pool_name] = pool
            self.policies[pool_name] = make_policy(rcfg, pool, self.index)
            n = {"prefill": cfg.prefill_replicas, "decode": cfg.decode_replicas}.get(pool_name, cfg.replicas)
            if cfg.autoscale is not None:
                n = cfg.autoscale.min_replicas
            for _ in range(n):
                self._add_replica(pool_name, role)
        self.scaler = None
        if cfg.autoscale is not None:
            self.scaler = Autoscaler(self.pools["main"], backend=None, cfg=cfg.autoscale)
            self.scale_events: list[dict] = []
            self.starting = 0
            self.draining: set[str] = set()
        self.hist: dict[str, tuple[list[int], list[int]]] = {}  # replica -> cumulative TTFT, ITL bucket counts
        self.inflight = self.peak = 0
        self.finished: list[Track] = []
        self.kv_seq: dict[str, int] = {}
        self.rids = itertools.count()
        self.pending = 0  # events other than the periodic scrape and tick

    # -- replicas --------------------------------------------------------------------------------------

    def _add_replica(self, pool_name: str, role: str) -> SimReplica:
        name = f"sim://{pool_name}-{len(self.lifetimes)}"
        sim = SimReplica(name, self.shape, self.costs, role, record=self.cfg.record_steps, kv_events=self.uses_events)
        sim.pool_name = pool_name
        sim.started_at = self.now
        self.sims[name] = self.every[name] = sim
        self.lifetimes[name] = [self.now, math.inf]
        r = self.pools[pool_name].add(name)
        r.healthy = True
        r.metrics.block_size, r.metrics.num_blocks = self.shape.block_size, self.shape.num_blocks
        r.scraped_at = 0.0
        return sim

    def _retire(self, name: str) -> None:
        sim = self.sims.pop(name)
        self.pools[sim.pool_name].remove(name)
        self.lifetimes[name][1] = self.now

    def _scrape(self) -> None:
        """Every replica's gauges as its /metrics would give them now."""
        for pool in self.pools.values():
            for r in pool.replicas.values():
                sim = self.sims[r.url]
                m = r.metrics
                m.waiting, m.running, m.kv_usage = sim.num_waiting, sim.num_running, sim.kv_usage
                r.scraped_at = self.now + 1.0  # never stale: the pool's stale_after is infinite
                if self.scaler is not None:
                    ttft, itl = self.hist.get(r.url) or ([0] * (len(TTFT_BUCKETS) + 1), [0] * (len(ITL_BUCKETS) + 1))
                    m.ttft = _histogram(TTFT_BUCKETS, ttft)
                    m.itl = _histogram(ITL_BUCKETS, itl)

    # -- the event loop --------------------------------------------------------------------------------

    def push(self, at: float, kind: int, payload=None) -> None:
        if kind not in (SCRAPE, TICK):
            self.pending += 1
        heapq.heappush(self.heap, (at, kind, next(self.seq), payload))

    def run(self, sessions: Iterator[SimSession], load: Load) -> FleetResult:
        self.load = load
        self.stream = _Stream(sessions, load.num_prompts)
        self.waiting_cap: list = []  # open loop over --max-concurrency: sessions waiting for a slot
        self.deadline = load.duration if load.duration is not None else math.inf
        if load.concurrency is not None:
            for _ in range(load.concurrency):
                self._next_session(0.0)
        else:
            from fulcrum.sim.workload import arrivals

            self.arrivals = arrivals(load.rate, load.burstiness, load.seed)
            self._schedule_arrival()
        self.push(0.0, SCRAPE)
        if self.scaler is not None:
            self.push(self.cfg.autoscale.tick, TICK)
        heap, pop = self.heap, heapq.heappop
        while heap:
            at, kind, _, payload = pop(heap)
            self.now = at
            self.events += 1
            if kind not in (SCRAPE, TICK):
                self.pending -= 1
            if kind == STEP_END:
                self._step_end(payload)
            elif kind == ENGINE_ARRIVE:
                self._engine_arrive(*payload)
            elif kind == SEND:
                self._send(*payload)
            elif kind == WAKE:
                sim = self.sims.get(payload)
                if sim is not None:
                    sim.waking = False
                    if sim.idle():
                        self._begin(sim)
            elif kind == SCRAPE:
                self._scrape()
                if self._busy():
                    self.push(at + self.cfg.scrape_interval, SCRAPE)
            elif kind == TICK:
                self._tick()
                if self._busy():
                    self.push(at + self.cfg.autoscale.tick, TICK)
            elif kind == PULL_DONE:
                self._pull_done(*payload)
            elif kind == REPLICA_UP:
                self._replica_up()
        return self._result()

    def _busy(self) -> bool:
        """Whether anything is left to happen besides the periodic scrape and tick."""
        return self.inflight > 0 or self.pending > 0

    # -- clients ---------------------------------------------------------------------------------------

    def _schedule_arrival(self) -> None:
        at = next(self.arrivals)
        if at >= self.deadline:
            return
        s = self.stream.next()
        if s is None:
            return
        if s.arrival is not None:  # a trace's own clock
            at = s.arrival
            if at >= self.deadline:
                return
        self.push(at, SEND, (s, 0, [], True))

    def _next_session(self, at: float) -> None:
        """Closed loop: a user's next session starts now."""
        if at >= self.deadline:
            return
        s = self.stream.next()
        if s is not None:
            self.push(at, SEND, (s, 0, [], False))

    def _send(self, s: SimSession, turn: int, history: list[int], arrival: bool) -> None:
        """A client sends turn `turn` of session `s` (with the conversation so far in `history`)."""
        if arrival:
            self._schedule_arrival()
            cap = self.load.max_concurrency
            if cap is not None and self.inflight >= cap:
                self.waiting_cap.append((s, turn, history))
                return
        prompt = s.system + history + s.turns[turn]
        tag = s.turn_tags[turn] if s.turn_tags else s.tag
        t = Track(s, turn, self.now, prompt, s.max_tokens[turn], tag=tag, input_len=len(prompt))
        t.rid, t.history = str(next(self.rids)), history + s.turns[turn]
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        self._route(t)

    def _done(self, t: Track) -> None:
        """A request's reply is complete at the client."""
        self.inflight -= 1
        self.finished.append(t)
        s = t.session
        if t.turn + 1 < len(s.turns) and t.error is None:  # a conversation cannot go on without its reply
            history = t.history + t.output_ids
            self.push(self.now, SEND, (s, t.turn + 1, history, False))
        elif self.load.concurrency is not None:
            self._next_session(self.now)
        if self.waiting_cap and (self.load.max_concurrency is None or self.inflight < self.load.max_concurrency):
            s2, turn, history = self.waiting_cap.pop(0)
            self.push(self.now, SEND, (s2, turn, history, False))

    # -- routing ---------------------------------------------------------------------------------------

    def _choose(self, pool_name: str, t: Track):
        pool = self.pools[pool_name]
        candidates = pool.available()
        if not candidates:
            return None
        hashes = t.hashes
        if hashes is None:
            hashes = t.hashes = hasher(t.prompt_ids) if self.cfg.policy != "round-robin" else (lambda bs: [])
        d = self.policies[pool_name].choose(candidates, hashes)
        self.routes[d.reason] = self.routes.get(d.reason, 0) + 1
        r = d.replica
        if self.remembers:
            r.remember(hashes(r.metrics.block_size or 16))
        r.in_flight += 1
        return r

    def _route(self, t: Track) -> None:
        hop = self.frontend_s + self.cfg.router_s
        if self.cfg.disaggregated:
            reason = self._direct_reason(t)
            if reason is None:
                r = self._choose("prefill", t)
                t.prefill_replica = r.url
                self.push(self.now + hop, ENGINE_ARRIVE, (r.url, t, "prefill"))
                return
            self.routes[f"pd:{reason}"] = self.routes.get(f"pd:{reason}", 0) + 1
            r = self._choose("decode", t)
        else:
            r = self._choose("main", t)
        if r is None:
            t.error = "http_503"
            t.finish = self.now
            self._done(t)
            return
        t.replica = r.url
        self.push(self.now + hop, ENGINE_ARRIVE, (r.url, t, "whole"))

    def _direct_reason(self, t: Track) -> str | None:
        """The P/D router's reasons to skip the prefill pool (router/pd.py), for what a simulated request has."""
        if len(t.prompt_ids) < self.cfg.pd.min_prompt_tokens:
            return "short-prompt"
        available = self.pools["prefill"].available()
        if not available:
            return "no-prefill-engine"
        if self.cfg.pd.max_prefill_load is not None:
            low = min(r.load(math.inf) for r in available)
            if low > self.cfg.pd.max_prefill_load:
                return "prefill-busy"
        return None

    # -- engines ---------------------------------------------------------------------------------------

    def _engine_arrive(self, name: str, t: Track, leg: str) -> None:
        sim = self.sims.get(name)
        if sim is None:  # retired meanwhile: cannot happen (a replica is retired with nothing in flight there)
            t.error = "connection"
            t.finish = self.now
            self._done(t)
            return
        priority = t.session.priority
        if leg == "prefill":
            sim.add(f"{t.rid}#prefill", t, t.prompt_ids, 1, self.now, priority)
        else:
            sim.add(t.rid, t, t.prompt_ids, t.max_tokens, self.now, priority)
        if sim.idle() and not sim.waking:
            sim.waking = True
            self.push(self.now, WAKE, name)

    def _begin(self, sim: SimReplica) -> None:
        end = sim.begin(self.now)
        if end is not None:
            self.push(end, STEP_END, sim.name)

    def _step_end(self, name: str) -> None:
        sim = self.sims[name]
        done = sim.end(self.now)
        if self.index is not None:
            self._apply_events(sim)
        hist = self.hist.get(name) if self.scaler is not None else None
        if self.scaler is not None and hist is None:
            hist = self.hist[name] = ([0] * (len(TTFT_BUCKETS) + 1), [0] * (len(ITL_BUCKETS) + 1))
        for rid, t in done:
            r = self.pools[sim.pool_name].replicas.get(name)
            if r is not None:
                r.in_flight -= 1
            if sim.role == "producer":
                self._prefill_done(sim, rid, t)
                continue
            if hist is not None:
                _observe(hist, t)
            t.replica = name
            self._done(t)
        self._begin(sim)
        if self.scaler is not None and name in self.draining:
            self._retire_if_drained(name)

    def _apply_events(self, sim: SimReplica) -> None:
        events = sim.kv.take_events()
        if events:
            seq = self.kv_seq.get(sim.name, -1) + 1
            self.kv_seq[sim.name] = seq
            self.index.apply(sim.name, seq, SimpleNamespace(events=events))

    # -- P/D -------------------------------------------------------------------------------------------

    def _prefill_done(self, producer: SimReplica, rid: str, t: Track) -> None:
        """The prefill leg answered: the decode engine is chosen now (as the P/D router does after the prefill) and
        pulls the prompt's blocks; the prefill engine's token is dropped (the decode engine computes the first)."""
        t.token_times.clear()
        t.prefill_rid = rid
        r = self._choose("decode", t)
        t.replica = r.url
        self.push(self.now + self.frontend_s + self.cfg.router_s, PULL_DONE, (r.url, t, producer.name, "start"))

    def _pull_done(self, name: str, t: Track, producer: str, phase: str) -> None:
        consumer = self.sims[name]
        if phase == "start":  # the decode request reached its engine: reserve and pull
            blocks = consumer.reserve_pull(t.rid, t.prompt_ids)
            if blocks:
                self.push(self.now + blocks * self.transfer_s, PULL_DONE, (name, t, producer, "in"))
                return
            self._release_lease(producer, t)
            self._engine_arrive(name, t, "decode")  # all cached here already, or no room: it prefills locally
            return
        consumer.finish_pull(t.rid, t.prompt_ids)
        self._release_lease(producer, t)
        self._engine_arrive(name, t, "decode")

    def _release_lease(self, producer: str, t: Track) -> None:
        self.every[producer].release_lease(t.prefill_rid)

    # -- autoscaling -----------------------------------------------------------------------------------

    def _tick(self) -> None:
        """The Autoscaler's loop body (router/autoscaler.py), on the simulated clock: observe, decide, one scale
        event at a time."""
        sc = self.scaler
        sc.decider.observe(self.now, sc.concurrency(), *sc._latency_deltas(), kv_usage=sc.kv_usage())
        if self.starting or self.draining:
            return
        current = len(self.pools["main"].replicas)
        n, reason = sc.decider.desired(self.now, current)
        if n > current:
            self.starting += 1
            self.scale_reason = reason
            self.push(self.now + self.cfg.replica_startup_s, REPLICA_UP)
        elif n < current:
            pool = self.pools["main"]
            r = min(pool.replicas.values(), key=lambda r: r.in_flight)
            r.draining = True
            self.draining.add(r.url)
            self.scale_reason = reason
            self._retire_if_drained(r.url)

    def _retire_if_drained(self, name: str) -> None:
        """A draining replica goes once the router has nothing in flight there, as the live autoscaler waits for
        it: a request still on its way in (the frontend's hop) counts, so it is never sent to a removed replica."""
        if self.pools["main"].replicas[name].in_flight == 0 and self.sims[name].idle():
            self._retire(name)
            self.draining.discard(name)
            self._scaled("down")

    def _replica_up(self) -> None:
        self.starting -= 1
        self._add_replica("main", "both")
        self._scrape()
        self._scaled("up")

    def _scaled(self, kind: str) -> None:
        n = len(self.pools["main"].replicas)
        self.scale_events.append({"at_s": self.now, "kind": kind, "replicas": n, "reason": self.scale_reason})

    # -- result ----------------------------------------------------------------------------------------

    def _result(self) -> FleetResult:
        end = self.now
        replica_seconds = sum(min(b, end) - a for a, b in self.lifetimes.values())
        per = {}
        for sim in self.every.values():
            kv = sim.kv.stats()
            a, b = self.lifetimes[sim.name]
            per[sim.name] = {
                "role": sim.role,
                "steps": sim.steps,
                "busy_s": sim.busy_s,
                "alive_s": min(b, end) - a,
                "prefix_cache_queries": kv.prefix_cache_queries,
                "prefix_cache_hits": kv.prefix_cache_hits,
                "preemptions": sim.scheduler.num_preemptions,
            }
        return FleetResult(
            tracks=self.finished,
            duration=end,
            peak_concurrency=self.peak,
            replica_seconds=replica_seconds,
            replicas=per,
            scale_events=getattr(self, "scale_events", []),
            routes=dict(self.routes),
            steps_log={s.name: s.log for s in self.every.values()} if self.cfg.record_steps else {},
            sim_events=self.events,
        )


def _histogram(bounds: tuple[float, ...], counts: list[int]) -> Histogram:
    """Cumulative bucket counts as a /metrics histogram reads (the last count is +Inf's)."""
    buckets, total = {}, 0
    for le, c in zip((*bounds, math.inf), counts):
        total += c
        buckets[le] = float(total)
    return Histogram(buckets, float(total))


def _observe(hist: tuple[list[int], list[int]], t: Track) -> None:
    ttft, itl = hist
    times = t.token_times
    if not times:
        return
    ttft[bisect.bisect_left(TTFT_BUCKETS, times[0] - t.start)] += 1
    for a, b in zip(times, times[1:]):
        itl[bisect.bisect_left(ITL_BUCKETS, b - a)] += 1
