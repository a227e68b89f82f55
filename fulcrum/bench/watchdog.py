"""Saying what a run is waiting for: when no request has completed for a while, a line on stderr with the
sweep point, the requests in flight and the oldest one's age, the last completion, and whether the event loop
still runs. A thread watches, because a blocked event loop fires no timeout and draws no progress.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Pulse:
    """The live state of a run: written by the load generator on the event loop, read by the watchdog thread
    (plain counters and a dict whose values are copied in one step, which the GIL keeps whole)."""

    total: int | None = None  # requests expected, when known
    done: int = 0
    what: str = "requests"  # or "warmup requests"
    phase: str = "starting"  # what the generator does when nothing is in flight
    request_timeout: float | None = None
    read_timeout: float | None = None
    last_done: float = field(default_factory=time.monotonic)  # the last completion, or the start
    inflight: dict[int, float] = field(default_factory=dict)  # request key -> monotonic time it was sent

    def reset(self, phase: str, total: int | None, what: str) -> None:
        self.phase, self.total, self.what, self.done = phase, total, what, 0
        self.last_done = time.monotonic()

    def sent(self, key: int) -> None:
        self.inflight[key] = time.monotonic()

    def finished(self, key: int) -> None:
        self.inflight.pop(key, None)
        self.done += 1
        self.last_done = time.monotonic()


def describe(pulse: Pulse, label: str, now: float, loop_silent: float | None = None) -> str:
    """One line: what the run at `label` is waiting for, at monotonic time `now`."""
    started = list(pulse.inflight.values())  # one copy: the loop may add or drop requests meanwhile
    of = f" of {pulse.total}" if pulse.total is not None else ""
    line = f"waiting: {label}: {pulse.done}{of} {pulse.what} done, none completed for {now - pulse.last_done:.0f} s; "
    if started:
        limits = [f"deadline {pulse.request_timeout:g} s"] if pulse.request_timeout else []
        limits += [f"{pulse.read_timeout:g} s of silence"] if pulse.read_timeout else []
        line += f"{len(started)} in flight, the oldest for {now - min(started):.0f} s"
        line += f" (cut at: {', '.join(limits)})" if limits else ""
    else:
        line += f"nothing in flight ({pulse.phase})"
    if loop_silent is not None:
        line += f"; the event loop has not run for {loop_silent:.0f} s (a synchronous call blocks it)"
    return line


class Watchdog:
    """While open, every `interval` seconds without a completed request, `emit`s `describe`'s line."""

    def __init__(self, pulse: Pulse, label: str, interval: float, emit: Callable[[str], None]):
        self.pulse, self.label, self.interval, self.emit = pulse, label, interval, emit
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-watchdog", daemon=True)
        self._answered = self._asked = time.monotonic()

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _answer(self) -> None:
        self._answered = time.monotonic()

    def _watch(self) -> None:
        last_line = 0.0
        tick = min(1.0, self.interval / 4)  # a line comes at most a quarter interval late
        while not self._stop.wait(tick):
            now = time.monotonic()
            # the loop answers a ping within milliseconds when it runs; an unanswered one means it is blocked
            silent = now - self._answered if self._answered < self._asked else None
            silent = silent if silent is not None and silent >= 2 * tick else None
            if now - max(self.pulse.last_done, last_line) >= self.interval:
                self.emit(describe(self.pulse, self.label, now, silent))
                last_line = now
            if self._answered >= self._asked:
                self._asked = time.monotonic()
                try:
                    self._loop.call_soon_threadsafe(self._answer)
                except RuntimeError:  # the loop has closed: the run is over
                    return
