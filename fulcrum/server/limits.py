"""What one client may make the server hold: a request body's size (413 past --max-request-body-mb, read before the
app parses it), the time to send a request's headers (a connection that dawdles is closed), and tokenizing, which
runs on a worker thread so that a huge prompt never stalls the event loop (and /health with it)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from uvicorn.protocols.http.h11_impl import H11Protocol

from fulcrum.errors import InvalidRequestError
from fulcrum.http_errors import error
from fulcrum.server.stages import ARRIVAL, bytes_found_at

# one thread: transformers' fast tokenizers may refuse concurrent calls on one instance ("Already borrowed")
_tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulcrum-tokenize")


async def json_body(request) -> object:
    """The request's body as JSON; a 400 when it is not JSON or nests too deeply to read (never a 500)."""
    try:
        return await request.json()
    except ValueError as e:
        raise InvalidRequestError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError("the body is nested too deeply to read as JSON") from None


async def off_loop(fn, *args):
    """fn(*args) on the tokenizing thread, awaited: the event loop serves other requests meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_tokenizing, lambda: fn(*args))


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 naming the limit, whether its Content-Length says
    so or its chunks add up to it; the body is read here, bounded, and handed on whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: disconnects, for streaming responses

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        mb = self.max_bytes / 2**20
        response = error(413, f"the request body is larger than the server's limit of {mb:g} MiB "
                              "(fulcrum serve --max-request-body-mb)")  # fmt: skip
        response.headers["connection"] = "close"
        await _drain(receive, DRAIN_FACTOR * self.max_bytes)
        await response(scope, receive, send)


# A client still sending its body when the 413 goes out and the connection closes reads a reset, not the 413: the
# rest is read and dropped first, up to this many times the limit and DRAIN_S seconds (past that, a reset it is)
DRAIN_FACTOR = 8
DRAIN_S = 10.0


async def _drain(receive, budget: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_S
    while budget > 0:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body"):
            return
        budget -= len(message.get("body", b""))


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete `timeout_s` after it
    opened or after its last response (uvicorn times out idle keep-alive connections, not half-sent headers)."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._first_bytes_at: float | None = None
            self._arm()

        def _arm(self) -> None:
            self._cycle_seen = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self.cycle is self._cycle_seen and not self.transport.is_closing():
                self.transport.close()  # no request began since: nothing to answer

        def data_received(self, data: bytes) -> None:
            # a request's first bytes, found readable by the event loop: its arrival (server/stages.py), before
            # they wait for the rest of the headers and for the event loop to start the app on them
            if self._first_bytes_at is None and (self.cycle is None or self.cycle.response_complete):
                self._first_bytes_at = bytes_found_at(self.loop)
            super().data_received(data)
            if self.cycle is not self._cycle_seen:  # a request's headers are complete
                self._header_timer.cancel()
                if self.cycle is not None and self._first_bytes_at is not None:
                    self.cycle.scope[ARRIVAL] = self._first_bytes_at
                self._first_bytes_at = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._header_timer.cancel()
                self._arm()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
