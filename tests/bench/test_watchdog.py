"""The watchdog's line: what a run that has stopped completing requests is waiting for."""

import asyncio
import time

from fulcrum.bench.watchdog import Pulse, Watchdog, describe


def test_the_line_names_the_point_the_requests_in_flight_and_the_oldest():
    pulse = Pulse(total=128, request_timeout=600, read_timeout=300)
    pulse.reset("sending", 128, "requests")
    pulse.done, t = 117, pulse.last_done
    pulse.inflight = {1: t + 5, 2: t + 20}
    line = describe(pulse, "concurrency 4 (point 2 of 4)", now=t + 95)
    assert line == (
        "waiting: concurrency 4 (point 2 of 4): 117 of 128 requests done, none completed for 95 s; "
        "2 in flight, the oldest for 90 s (cut at: deadline 600 s, 300 s of silence)"
    )


def test_the_line_says_so_when_nothing_is_in_flight():
    pulse = Pulse()
    pulse.reset("drawing sessions", None, "requests")
    line = describe(pulse, "rate 4/s", now=pulse.last_done + 31, loop_silent=31)
    assert "0 requests done" in line and "nothing in flight (drawing sessions)" in line
    assert line.endswith("the event loop has not run for 31 s (a synchronous call blocks it)")


def test_a_blocked_event_loop_is_reported_from_the_watchdog_thread():
    async def main():
        lines = []
        pulse = Pulse()
        pulse.sent(1)
        with Watchdog(pulse, "concurrency 1", 0.2, lines.append):
            time.sleep(1.0)  # a synchronous call holds the loop: no timeout can fire, no progress is drawn
            await asyncio.sleep(0)
        return lines

    lines = asyncio.run(main())
    assert lines and all(line.startswith("waiting: concurrency 1: 0 requests done") for line in lines)
    assert any("1 in flight" in line and "the event loop has not run for" in line for line in lines)


def test_no_line_once_closed():
    async def main():
        lines = []
        with Watchdog(Pulse(), "concurrency 1", 0.2, lines.append):
            pass
        await asyncio.sleep(0.5)
        return lines

    assert asyncio.run(main()) == []
