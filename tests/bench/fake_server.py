"""A scripted OpenAI-style streaming server for the load generator's tests.

Each request's prompt (or last user message) names a script: a list of steps, each a time and an
action. With a `ScriptClock` the server sets the virtual time before each line it sends and waits
until the client has read the clock, so the client's timings come out exactly as scripted.
`serving_in_thread` runs it beside code that runs its own event loop (the CLI).
"""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager, contextmanager

from aiohttp import web
from aiohttp.test_utils import TestServer


class ScriptClock:
    """A clock the server moves: the client reads `now`; `reads` tells the server it has been read."""

    def __init__(self):
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def usage_chunk(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def stream(*events: tuple[float, dict | str | bytes], done_at: float | None = None) -> list:
    """A script: (seconds after arrival, chunk) pairs, then `[DONE]`, unless done_at is None and omitted."""
    steps = []
    for t, e in events:
        raw = e if isinstance(e, bytes) else (e if isinstance(e, str) else json.dumps(e)).encode()
        steps.append((t, b"data: " + raw + b"\n\n"))
    if done_at is not None:
        steps.append((done_at, b"data: [DONE]\n\n"))
    return steps


class FakeServer:
    def __init__(self, scripts: dict, clock: ScriptClock | None = None):
        self.scripts = scripts  # name -> list of (t, bytes) | ("status", code, body) | callable
        self.clock = clock
        self.bodies: list[dict] = []
        self.inflight = self.peak = 0

    def name_of(self, body: dict) -> str:
        if "messages" in body:
            return body["messages"][-1]["content"]
        return body["prompt"]

    async def handle(self, request: web.Request):
        body = await request.json()
        self.bodies.append(body)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            script = self.scripts.get(self.name_of(body), self.scripts.get("*"))
            if isinstance(script, tuple) and script[0] == "status":
                return web.Response(status=script[1], text=script[2], content_type="application/json")
            if callable(script):
                return await script(request, body)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            arrival = self.clock.now if self.clock else 0.0
            for t, line in script:
                if line == b"DROP":
                    request.transport.close()  # the connection dies mid-stream
                    return resp
                if line == b"STALL":
                    await until_gone(request)  # the stream goes silent, the connection stays open
                    return resp
                if self.clock is None:
                    await asyncio.sleep(t)  # real time: t is a pause before the line
                    await resp.write(line)
                    continue
                reads = self.clock.reads
                self.clock.now = arrival + t
                await resp.write(line)
                while self.clock.reads == reads:  # until the client has taken the line's time
                    await asyncio.sleep(0.001)
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1

    async def models(self, request: web.Request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        return app


async def until_gone(request: web.Request) -> None:
    """Send nothing until the client has closed the connection (the client's deadline bounds the wait)."""
    while request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(0.02)


STALL = (0.0, b"STALL")


@asynccontextmanager
async def serving(fake: FakeServer):
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


@contextmanager
def serving_in_thread(fake: FakeServer):
    """`serving` on an event loop of its own in a thread; its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-server", daemon=True)
    thread.start()
    cm = serving(fake)
    try:
        url = asyncio.run_coroutine_threadsafe(cm.__aenter__(), loop).result(timeout=10)
        try:
            yield url
        finally:
            asyncio.run_coroutine_threadsafe(cm.__aexit__(None, None, None), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
