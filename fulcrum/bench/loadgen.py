"""The load: a closed loop (N users, each sending its next request when the last one ends) or an
open loop (arrivals with gamma-distributed gaps: burstiness 1 is a Poisson process, lower is burstier).

A session's turns go one after another, each carrying the history and the replies so far. The run
stops at `num_prompts` sessions or after `duration` seconds (no new sessions after it), and on `stop`
(Ctrl-C) the requests in flight are cancelled and recorded as interrupted, so a partial run is kept.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from fulcrum.bench.client import RequestResult, Target, build_payload, send
from fulcrum.bench.workloads import Session


@dataclass
class LoadSpec:
    concurrency: int | None = None  # closed loop: users
    request_rate: float | None = None  # open loop: sessions per second (inf: all at once)
    burstiness: float = 1.0
    max_concurrency: int | None = None  # open loop: a cap on requests in flight
    num_prompts: int | None = 100
    duration: float | None = None
    warmup: int = 0

    def __post_init__(self):
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give either a concurrency (closed loop) or a request rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request rate must be > 0")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        if self.num_prompts is None and self.duration is None:
            raise ValueError("give --num-prompts, --duration or both")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"rate {rate}/s" + (f" (burstiness {self.burstiness:g})" if self.burstiness != 1 else "")

    def as_dict(self) -> dict:
        d = {"concurrency": self.concurrency, "request_rate": self.request_rate, "burstiness": self.burstiness}
        d.update(max_concurrency=self.max_concurrency, num_prompts=self.num_prompts, duration=self.duration)
        if d["request_rate"] is not None and math.isinf(d["request_rate"]):
            d["request_rate"] = "inf"
        return d


@dataclass
class RunResult:
    load: LoadSpec
    duration: float
    peak_concurrency: int
    interrupted: bool
    results: list[RequestResult] = field(default_factory=list)


def arrival_gaps(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Gaps between arrivals: gamma with mean 1/rate and shape `burstiness` (1 = exponential = Poisson)."""
    while True:
        yield 0.0 if math.isinf(rate) else float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


class LoadGenerator:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        *,
        extra: dict | None = None,
        count_tokens: Callable[[str], int] | None = None,
        timeout: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        on_result: Callable[[RequestResult, int], None] | None = None,
        seed: int = 0,
    ):
        self.http, self.target, self.extra = http, target, extra or {}
        self.count_tokens, self.timeout, self.clock = count_tokens, timeout, clock
        self.on_result = on_result
        self.seed = seed
        self.inflight = self.peak = 0

    async def run(self, load: LoadSpec, sessions: Iterable[Session], stop: asyncio.Event | None = None) -> RunResult:
        it = iter(sessions)
        if load.warmup:
            warm = LoadSpec(concurrency=min(load.warmup, load.concurrency or load.max_concurrency or load.warmup))
            await self._closed(warm, itertools.islice(it, load.warmup), [], self.clock(), None)
        if load.num_prompts is not None:
            it = itertools.islice(it, load.num_prompts)
        results: list[RequestResult] = []
        self.inflight = self.peak = 0
        t0 = self.clock()
        deadline = t0 + load.duration if load.duration else None
        if load.concurrency is not None:
            work = self._closed(load, it, results, t0, deadline)
        else:
            work = self._open(load, it, results, t0, deadline)
        main = asyncio.ensure_future(work)
        interrupted = False
        if stop is not None:
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([main, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not main.done():
                interrupted = True
                main.cancel()
        try:
            await main
        except asyncio.CancelledError:
            if not interrupted:
                raise
        return RunResult(load, self.clock() - t0, self.peak, interrupted, results)

    async def _closed(self, load, it, results, t0, deadline) -> None:
        async def user():
            for s in it:  # one shared iterator: each user takes the next session
                if deadline is not None and self.clock() >= deadline:
                    return
                await self._session(s, results, t0)

        await self._all([user() for _ in range(load.concurrency)])

    async def _open(self, load, it, results, t0, deadline) -> None:
        gaps = arrival_gaps(load.request_rate, load.burstiness, np.random.default_rng(self.seed))
        cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        tasks = []
        next_at = t0
        try:
            for s in it:
                if deadline is not None and next_at >= deadline:
                    break
                if (wait := next_at - self.clock()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.ensure_future(self._session(s, results, t0, cap)))
                next_at += next(gaps)
        except asyncio.CancelledError:
            await _cancel_all(tasks)
            raise
        await self._all(tasks)

    async def _all(self, aws) -> None:
        """Await all; when cancelled, cancel them all and wait until each has recorded its request."""
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            await _cancel_all(tasks)
            raise

    async def _session(self, s: Session, results: list, t0: float, cap: asyncio.Semaphore | None = None) -> None:
        history = [{"role": "system", "content": s.system}] if s.system else []
        for k, user_text in enumerate(s.user_turns):
            history.append({"role": "user", "content": user_text})
            tag = s.turn_tags[k] if s.turn_tags else s.tag
            r = RequestResult(session=s.id, turn=k, tag=tag, input_len=s.input_lens[k])
            body = build_payload(self.target, history, s.max_tokens[k], self.extra)
            if cap is not None:
                await cap.acquire()
            r.start = self.clock() - t0
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            try:
                await send(self.http, self.target, body, r, self.clock, self.count_tokens, self.timeout)
            except asyncio.CancelledError:
                r.ok, r.error, r.error_detail = False, "interrupted", "cancelled by the user"
                raise
            finally:
                self.inflight -= 1
                if cap is not None:
                    cap.release()
                results.append(r)
                if self.on_result:
                    self.on_result(r, self.inflight)
            if not r.ok:
                return  # a conversation cannot go on without its reply
            history.append({"role": "assistant", "content": r.text})


async def _cancel_all(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
