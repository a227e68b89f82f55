"""Goodput under the SLO, measured: a candidate is started and loaded by `fulcrum bench`'s load generator at rising
concurrency (closed loop) until the SLO breaks or throughput stops rising (two points in a row). Its goodput is the
request throughput of the best load point that met every bound; a point already lost (`EarlyBreak`) is cut short."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fulcrum.bench.client import Target, discover_model
from fulcrum.bench.loadgen import LoadGenerator, LoadSpec
from fulcrum.bench.metrics import summarize
from fulcrum.bench.workloads import TextMaker, WorkloadSpec, sessions
from fulcrum.tune.launch import Launcher
from fulcrum.tune.space import Config
from fulcrum.tune.target import Bound, EarlyBreak, slo_misses

# the server is saturated after this many points in a row that did not raise the best throughput by this factor
# (two, so that one noisy point does not end the load early)
SATURATED_GAIN, SATURATED_POINTS = 1.05, 2


@dataclass
class Point:
    concurrency: int
    summary: dict
    misses: list[str]
    cut_short: str | None = None

    @property
    def passed(self) -> bool:
        return not self.misses and not self.cut_short and not self.summary["failed"]

    @property
    def throughput(self) -> float:
        return self.summary["request_throughput"]


@dataclass
class Measurement:
    """What a candidate did: every load point, and the best one that met the SLO."""

    points: list[Point] = field(default_factory=list)
    error: str | None = None  # it did not start, or its load failed
    seconds: float = 0.0

    @property
    def best(self) -> Point | None:
        good = [p for p in self.points if p.passed]
        return max(good, key=lambda p: p.throughput) if good else None

    @property
    def goodput(self) -> float:
        return self.best.throughput if self.best else 0.0

    def figure(self, name: str) -> float | None:
        """A figure of the best point (the first point when none met the SLO): ttft_p90 (ms), output_throughput..."""
        p = self.best or (self.points[0] if self.points else None)
        if p is None:
            return None
        if name in p.summary:
            return p.summary[name]
        metric, _, stat = name.partition("_")
        return p.summary[f"{metric}_ms"][stat]

    def breaks(self) -> str:
        """Why the load stopped rising, in words."""
        if self.error:
            return self.error
        failed = next((p for p in self.points if not p.passed), None)
        if failed is None:
            return "throughput stopped rising" if self.points else "not measured"
        why = failed.cut_short or "; ".join(failed.misses) or f"{failed.summary['failed']} requests failed"
        return f"at concurrency {failed.concurrency}: {why}"

    def as_dict(self) -> dict:
        return {
            "goodput_rps": self.goodput,
            "error": self.error,
            "seconds": self.seconds,
            "breaks": self.breaks(),
            "points": [
                {
                    "concurrency": p.concurrency,
                    "passed": p.passed,
                    "misses": p.misses,
                    "cut_short": p.cut_short,
                    "summary": p.summary,
                }
                for p in self.points
            ],  # fmt: skip
        }


@dataclass
class LoadPlan:
    """How hard and how long each candidate is loaded."""

    max_concurrency: int = 64
    point_seconds: float = 20.0  # no new request after this long at one load point
    min_requests: int = 10  # per point, so that a p90 rests on some requests
    requests_per_user: int = 3
    warmup: int = 2  # requests each server answers unmeasured before its first point (GPU kernels compile then)
    turns: int = 1  # requests per session (a conversation's turns): what a point's session count sends
    target_rate: float | None = None  # requests/s: a point reaching it needs no higher load

    def ladder(self, start: int) -> list[int]:
        out, c = [], max(1, start)
        while c < self.max_concurrency:
            out.append(c)
            c *= 2
        return out + [self.max_concurrency]


class LiveMeasurer:
    """Measures candidates for real: starts each through `launcher` and loads it with the workload."""

    def __init__(
        self,
        launcher: Launcher,
        workload: WorkloadSpec,
        text: TextMaker,
        slo: list[Bound],
        load: LoadPlan,
        *,
        endpoint: str = "completions",
        on_point=None,
    ):
        self.launcher, self.workload, self.text, self.slo, self.load = launcher, workload, text, slo, load
        self.endpoint, self.on_point = endpoint, on_point
        self.runs = 0  # each run draws fresh prompts, so no prefix cache serves one run from another

    def measure(self, config: Config, start_at: int = 1, deadline: float | None = None) -> Measurement:
        t0 = time.monotonic()
        m = Measurement()
        try:
            with self.launcher.serving(config) as url:
                asyncio.run(self._ladder(url, m, start_at, deadline))
        except (RuntimeError, OSError, ValueError) as e:  # did not start, or its load could not be sent
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["(no message)"]
            last = f" ... {lines[-1][:300]}" if len(lines) > 1 else ""  # a log's last line: the error itself
            m.error = lines[0][:300] + last
        m.seconds = time.monotonic() - t0
        return m

    async def _ladder(self, url: str, m: Measurement, start_at: int, deadline: float | None) -> None:
        import aiohttp

        self.runs += 1
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
            try:
                model = await discover_model(http, url, {})
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                raise RuntimeError(f"cannot reach {url}: {e}") from None
            target = Target(url, model, self.endpoint)
            count = self.text.count if self.text.exact else None
            top, flat = 0.0, 0  # the highest throughput so far, and the points since it last rose
            for i, c in enumerate(self.load.ladder(start_at)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left < 2 and m.points:
                    break
                point = await self._point(http, target, count, c, i, left)
                m.points.append(point)
                if self.on_point:
                    self.on_point(point)
                if not point.passed:
                    break
                rate = self.load.target_rate
                if rate and point.throughput >= rate:
                    break
                flat = 0 if point.throughput >= top * SATURATED_GAIN else flat + 1
                top = max(top, point.throughput)
                if flat >= SATURATED_POINTS:
                    break

    async def _point(self, http, target, count, c: int, i: int, left: float | None) -> Point:
        n = max(self.load.min_requests, self.load.requests_per_user * c)
        seconds = self.load.point_seconds if left is None else max(1.0, min(self.load.point_seconds, left))
        spec = LoadSpec(concurrency=c, num_prompts=n, duration=seconds, warmup=self.load.warmup if i == 0 else 0)
        early = EarlyBreak(self.slo, n * self.load.turns)  # more planned than sent only lets more misses by
        stop = asyncio.Event()

        def on_result(r, _inflight: int) -> None:
            if early.add(r):
                stop.set()

        timeout = max(60.0, 20 * max(b.seconds for b in self.slo))
        gen = LoadGenerator(http, target, extra={"temperature": 0.0, "ignore_eos": True}, count_tokens=count,
                            timeout=timeout, read_timeout=timeout, on_result=on_result, seed=1000 * self.runs + i)  # fmt: skip
        workload = WorkloadSpec(**{**self.workload.__dict__, "seed": self.workload.seed + 1000 * self.runs + i})
        run = await gen.run(spec, sessions(workload, self.text), stop)
        done = [r for r in run.results if r.error != "interrupted"] if early.reason else run.results
        summary = summarize(done, run.duration)
        return Point(c, summary, slo_misses(summary, self.slo), early.reason)
