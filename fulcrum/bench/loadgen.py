"""The load: a closed loop (N users, each sending its next request when the last one ends) or an
open loop (arrivals with gamma-distributed gaps: burstiness 1 is a Poisson process, lower is burstier).

A session's turns go one after another, each carrying the history and the replies so far. A run ends at
`num_prompts` sessions, after `duration` seconds or on `stop` (Ctrl-C), and keeps what it measured."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from fulcrum.bench.client import RequestResult, Target, build_payload, send
from fulcrum.bench.watchdog import Pulse
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
        checks = {
            "concurrency must be >= 1": self.concurrency is None or self.concurrency >= 1,
            "request rate must be > 0": self.request_rate is None or self.request_rate > 0,
            "burstiness must be > 0": self.burstiness > 0,
            "max concurrency must be >= 1": self.max_concurrency is None or self.max_concurrency >= 1,
            "num prompts must be >= 1": self.num_prompts is None or self.num_prompts >= 1,
            "duration must be > 0": self.duration is None or self.duration > 0,
            "warmup must be >= 0": self.warmup >= 0,
            "give --num-prompts, --duration or both": self.num_prompts is not None or self.duration is not None,
            "an infinite request rate needs --num-prompts (it would start sessions without end)": not (
                self.num_prompts is None and self.request_rate is not None and math.isinf(self.request_rate)
            ),
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(message)

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


class SessionSource:
    """The sessions of a run: all drawn up front (`draw`) when their number is known, else drawn in a worker thread
    as the run takes them. Drawing is tokenizer work (prompt text): done on the event loop during the run, it would
    stall it and inflate every in-flight request's ITL. Up front it runs in a worker thread too, DRAW_CHUNK sessions
    a call, so that a stop (Ctrl-C, SIGTERM) ends a long draw after the chunk in hand."""

    DRAW_CHUNK = 64

    def __init__(self, sessions: Iterable[Session], count: int | None):
        self._it = iter(sessions)
        self._count = count
        self._ready: list[Session] | None = None
        self._next = 0
        self._lock: asyncio.Lock | None = None  # one draw at a time: a generator runs in one thread at once

    async def draw(self, pulse: Pulse | None = None) -> None:
        """Draw the `count` sessions (nothing to do without one); `pulse.done` counts them as they come."""
        if self._count is None or self._ready is not None:
            return
        ready: list[Session] = []
        while len(ready) < self._count:
            chunk = await asyncio.to_thread(lambda n: list(itertools.islice(self._it, n)),
                                            min(self.DRAW_CHUNK, self._count - len(ready)))  # fmt: skip
            ready += chunk
            if pulse is not None:  # progress: the watchdog stays quiet while chunks come
                pulse.done, pulse.last_done = len(ready), time.monotonic()
            if not chunk:
                break
        self._ready = ready

    @property
    def requests(self) -> int | None:
        """Requests the sessions hold (every turn), once drawn up front."""
        return None if self._ready is None else sum(len(s.user_turns) for s in self._ready)

    async def next(self) -> Session | None:
        if self._count is not None:
            await self.draw()
            if self._next >= len(self._ready):
                return None
            self._next += 1
            return self._ready[self._next - 1]
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            return await asyncio.to_thread(next, self._it, None)


class LoadGenerator:
    """Sends a run's load and records every request. Each request has a deadline (client.send), so no run waits
    forever on a server; `pulse` tells a watchdog what the run is doing meanwhile."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        *,
        extra: dict | None = None,
        count_tokens: Callable[[str], int] | None = None,
        timeout: float | None = None,
        read_timeout: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        on_result: Callable[[RequestResult, int], None] | None = None,
        seed: int = 0,
    ):
        self.http, self.target, self.extra = http, target, extra or {}
        self.count_tokens, self.timeout, self.read_timeout, self.clock = count_tokens, timeout, read_timeout, clock
        self.on_result = on_result
        self.seed = seed
        self.inflight = self.peak = 0
        self.pulse = Pulse(request_timeout=timeout, read_timeout=read_timeout)
        self.load: LoadSpec | None = None
        self.results: list[RequestResult] = []  # the measured requests so far, for `partial()`
        self.t0: float | None = None

    async def run(
        self,
        load: LoadSpec,
        sessions: Iterable[Session],
        stop: asyncio.Event | None = None,
        before_measuring: Callable[[], Awaitable[None]] | None = None,
    ) -> RunResult:
        """Warm up, then run `load` until `num_prompts` sessions are done or `duration` is up (no new session starts
        after it). On `stop` the requests in flight are cancelled and recorded as interrupted, so a partial run is
        kept; `partial()` gives it also when the run itself was cancelled. `before_measuring` is awaited between
        the warm-up and the measured requests."""
        it = iter(sessions)
        self.load, self.results, self.t0 = load, [], None
        if load.warmup:
            warm = LoadSpec(concurrency=min(load.warmup, load.concurrency or load.max_concurrency or load.warmup))
            source = await self._drawn(it, load.warmup, "warmup ", stop)
            if source is None or await until_stop(
                self._closed(warm, source, [], self.clock(), None, report=False), stop
            ):
                return RunResult(load, 0.0, 0, True)
        if before_measuring is not None:
            await before_measuring()
        source = await self._drawn(it, load.num_prompts, "", stop)
        if source is None:
            return RunResult(load, 0.0, 0, True)
        results = self.results
        self.inflight = self.peak = 0
        t0 = self.t0 = self.clock()
        deadline = t0 + load.duration if load.duration else None
        if load.concurrency is not None:
            work = self._closed(load, source, results, t0, deadline)
        else:
            work = self._open(load, source, results, t0, deadline)
        interrupted = await until_stop(work, stop)
        duration = self.clock() - t0
        self.pulse.phase = "counting output tokens"
        await asyncio.to_thread(count_output_tokens, results, self.count_tokens)
        return RunResult(load, duration, self.peak, interrupted, results)

    async def _drawn(self, it: Iterator[Session], count: int | None, kind: str,
                     stop: asyncio.Event | None) -> SessionSource | None:  # fmt: skip
        """The next `count` sessions of `it`, drawn up front (`kind`: "warmup " or ""), the pulse saying so; None
        when `stop` came first."""
        self.pulse.reset(f"drawing {kind}sessions", count, f"{kind}sessions")
        source = SessionSource(it, count)
        if await until_stop(source.draw(self.pulse), stop):
            return None
        self.pulse.reset("sending", source.requests, f"{kind}requests")
        return source

    def partial(self) -> RunResult:
        """What the run measured before it was cut short (cancelled, or an error): the requests it recorded,
        the ones in flight among them as interrupted."""
        duration = self.clock() - self.t0 if self.t0 is not None else 0.0
        results = list(self.results)
        count_output_tokens(results, self.count_tokens)
        return RunResult(self.load, duration, self.peak, True, results)

    async def _closed(self, load, source, results, t0, deadline, report: bool = True) -> None:
        async def user():
            while (s := await source.next()) is not None:  # each user takes the next session
                if deadline is not None and self.clock() >= deadline:
                    return
                await self._session(s, results, t0, report=report)

        await _all([user() for _ in range(load.concurrency)])

    async def _open(self, load, source, results, t0, deadline) -> None:
        gaps = arrival_gaps(load.request_rate, load.burstiness, np.random.default_rng(self.seed))
        cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        tasks = []
        next_at = t0
        try:
            while (s := await source.next()) is not None:
                if deadline is not None and max(next_at, self.clock()) >= deadline:
                    break
                self.pulse.phase = "waiting for the next arrival"
                await asyncio.sleep(max(0.0, next_at - self.clock()))  # always yields: requests already out progress
                self.pulse.phase = "sending"
                tasks.append(asyncio.ensure_future(self._session(s, results, t0, cap)))
                next_at += next(gaps)
        except asyncio.CancelledError:
            await _cancel_all(tasks)
            raise
        await _all(tasks)

    async def _session(self, s: Session, results: list, t0: float, cap=None, report: bool = True) -> None:
        history = [{"role": "system", "content": s.system}] if s.system else []
        prompt_len = s.system_len  # intended tokens of the whole prompt: system, every turn so far, the replies
        for k, user_text in enumerate(s.user_turns):
            history.append({"role": "user", "content": user_text})
            prompt_len += s.input_lens[k]
            tag = s.turn_tags[k] if s.turn_tags else s.tag
            r = RequestResult(session=s.id, turn=k, tag=tag, input_len=prompt_len)
            body = build_payload(self.target, history, s.max_tokens[k], self.extra)
            if cap is not None:
                await cap.acquire()
            # from here on every path gives the slot back and records the request, whatever happens inside
            r.start = self.clock() - t0
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            self.pulse.sent(id(r))
            try:
                await send(self.http, self.target, body, r, self.clock, self.timeout, self.read_timeout)
            except BaseException:
                # send turns every Exception into a failed result: what reaches here stops the run (cancel, Ctrl-C)
                r.ok, r.error, r.error_detail = False, "interrupted", "cancelled by the user"
                raise
            finally:
                self.inflight -= 1
                if cap is not None:
                    cap.release()
                self.pulse.finished(id(r))
                results.append(r)
                if self.on_result and report:
                    self.on_result(r, self.inflight)
            if not r.ok:
                return  # a conversation cannot go on without its reply
            history.append({"role": "assistant", "content": r.text})
            prompt_len += r.output_tokens if r.token_source == "usage" else len(r.chunk_times)


def count_output_tokens(results: list[RequestResult], count_tokens: Callable[[str], int] | None) -> None:
    """Output tokens of requests the server gave no usage for: the tokenizer's count of the text, done after
    the run (tokenizing during it would stall the loop that times the other requests), else the chunks."""
    for r in results:
        if r.ok and r.token_source not in ("usage", "tokenizer"):
            if count_tokens is not None:
                r.output_tokens, r.token_source = count_tokens(r.text), "tokenizer"
            else:
                r.output_tokens, r.token_source = len(r.chunk_times), "chunks"


async def until_stop(work, stop: asyncio.Event | None) -> bool:
    """Run `work` (a coroutine or task) to its end, or cancel it when `stop` is set first; whether it was
    stopped. What went wrong inside `work` is raised here. Cancelled itself, it cancels `work` and waits for
    it: asyncio.wait alone would leave `work` running on, unseen, after its caller has gone."""
    main = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        await asyncio.wait([t for t in (main, stopper) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel_all([main])
        raise
    finally:
        if stopper is not None:
            stopper.cancel()
    if main.done():
        main.result()  # re-raise what went wrong inside
        return False
    main.cancel()
    try:
        await main
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # this task was cancelled too (Ctrl-C under asyncio.run): go on
            raise
    return True


async def _all(aws) -> None:
    """Await all. When cancelled, or when one of them fails, cancel the rest and wait until each has recorded
    its request: gather alone would leave them running on, unseen, while the failure ends the run."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await _cancel_all(tasks)
        raise


async def _cancel_all(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
