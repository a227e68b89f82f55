"""Graceful shutdown: on SIGTERM stop taking requests, let those in flight finish for up to the drain
timeout, then cut the rest so each client still gets a complete answer: a 503 in OpenAI's shape, or an
error event and `[DONE]` on a stream. The exit code says whether anything was cut."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from fulcrum.errors import ShuttingDownError
from fulcrum.server.state import ServerState

log = logging.getLogger("fulcrum.serve")
EXIT_CUT = 3  # requests were cut at shutdown (1 is an engine failure)
ANSWER_GRACE_S = 5  # after the cut, time for handlers to send their 503s and error events


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        # a second signal forces the exit, as uvicorn's own handler does for a second Ctrl-C
        if self.should_exit and sig in (signal.SIGINT, signal.SIGTERM):
            self.force_exit = True
        self.should_exit = True
        self.state.draining = True
        # uvicorn re-raises caught signals after its shutdown (the process dies of them); our exit code says it all
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        for server in self.servers:  # no new connections while the rest drain
            server.close()
        engine = self.state.engine
        deadline = time.monotonic() + self.drain_timeout
        if engine.num_in_flight:
            log.info("draining %d requests (up to %.0f s)", engine.num_in_flight, self.drain_timeout)
        while engine.num_in_flight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            error = ShuttingDownError(
                f"the server shut down before this request finished (drain timeout {self.drain_timeout:g} s)"
            )
            for request_id, tokens in engine.cut_all(error):
                log.warning("request %s cut at shutdown after %d generated tokens", request_id, tokens)
                self.exit_code = EXIT_CUT
        await super().shutdown(sockets)
