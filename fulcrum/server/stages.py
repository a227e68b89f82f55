"""Where a request's time goes before the engine sees it. The HTTP protocol (server/limits.py) stamps the moment
the event loop found a request's first bytes readable (WakeStampingLoop: the end of the wait that saw them, before
the callbacks queued ahead of their read ran; an ASGI middleware, when another protocol runs the app, the moment the
app gets it); the server's TTFT, end-to-end and queue clocks start there (as the user feels it, not after the headers are
complete, the body parsed and the prompt tokenized), and each frontend stage up to the engine is timed into
fulcrum:frontend_stage_seconds{stage} and logged at debug level:

- receive: the rest of the headers, the body read, parsed and validated, and the route's own translation
  (Responses, Messages);
- tokenize: the chat template rendered and the prompt tokenized;
- params: the sampling parameters checked (a grammar built).
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import time

from fastapi import Request

log = logging.getLogger("fulcrum.server")

ARRIVAL = "fulcrum.arrival"  # the scope key of the arrival time (time.time())
STAGES = ("receive", "tokenize", "params")
STAGE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.5)


class WakeClock(selectors.DefaultSelector):
    """The event loop's selector, noting when each of its waits ended (time.time())."""

    woke_at = 0.0

    def select(self, timeout=None):
        ready = super().select(timeout)
        self.woke_at = time.time()
        return ready


class WakeStampingLoop(asyncio.SelectorEventLoop):
    """asyncio's loop, which knows when its last wait for sockets ended: the moment it learned a socket had data,
    which a protocol reading that socket sees later by as long as the callbacks queued ahead of the read took (the
    frontend streaming other requests' tokens, say)."""

    def __init__(self):
        self.wake_clock = WakeClock()
        super().__init__(self.wake_clock)

    def woke_at(self) -> float:
        return self.wake_clock.woke_at


def bytes_found_at(loop: asyncio.AbstractEventLoop) -> float:
    """When the running loop found the bytes a protocol is reading now readable: the end of its last wait on a
    WakeStampingLoop, else now."""
    now = time.time()
    woke = loop.woke_at() if isinstance(loop, WakeStampingLoop) else 0.0
    return woke if 0 < woke <= now else now


class StampArrival:
    """ASGI middleware, outermost but for CORS: the time each HTTP request arrived, in its scope, unless the HTTP
    protocol (server/limits.py) stamped it when it read the request's first bytes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault(ARRIVAL, time.time())  # stamped already where the protocol read its first bytes
        return await self.app(scope, receive, send)


def arrival_of(request: Request) -> float:
    """When the request arrived over HTTP (now, for a request that came some other way)."""
    return request.scope.get(ARRIVAL) or time.time()


class StageClock:
    """One request's frontend stages: mark(stage) closes the stage that ran since the previous mark (the first one
    since the arrival) and records it."""

    def __init__(self, request: Request, histogram=None):
        self.arrival = self.last = arrival_of(request)
        self.histogram = histogram  # a metrics family with a `stage` label (ServerMetrics.frontend), or None
        self.times: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        now = time.time()
        self.times[stage] = now - self.last
        self.last = now
        if self.histogram is not None:
            self.histogram.observe(self.times[stage], stage=stage)
        if stage == STAGES[-1] and log.isEnabledFor(logging.DEBUG):
            log.debug("frontend %s", ", ".join(f"{s} {t * 1e3:.2f} ms" for s, t in self.times.items()))
