"""The router's OpenAI-compatible front: each request is checked against the schemas of fulcrum/protocol.py,
given to one replica by the policy and streamed back. A replica that fails or times out before the first event
has the request retried on another; once an event has reached the client it never is, and a stream cut midway
ends with an error event and [DONE]. Every request ends with its tokens or an error."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from fulcrum import http_errors
from fulcrum.http_errors import error, error_body
from fulcrum.protocol import ChatCompletionRequest, CompletionRequest
from fulcrum.router.kv_index import KVIndex, Subscriber, Subscriptions
from fulcrum.router.metrics import RouterMetrics
from fulcrum.router.policies import NEEDS_TOKENS, POLICIES, Decision
from fulcrum.router.pool import Pool, Replica
from fulcrum.router.tokens import PromptTokenizer, hasher
from fulcrum.utils import web_page

log = logging.getLogger("fulcrum.router")
OPEN_PATHS = {"/health", "/ping", "/metrics", "/version", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}
RETRY_STATUS = {500, 502, 503, 504}  # a replica failing, draining or overloaded: another may answer
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "keep-alive"}


def sse_error(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


class Failed(Exception):
    """This replica cannot answer this request now (connection, timeout, 5xx): try another."""

    def __init__(self, status: int, message: str, dead: bool):
        super().__init__(message)
        self.status, self.dead = status, dead


@dataclass
class RouterConfig:
    policy: str = "round-robin"
    model: str | None = None  # tokenizer folder or Hub ID for prefix-aware policies
    balance_margin: float = 4.0
    prefix_weight: float = 1.0
    load_weight: float = 0.1
    sticky_header: str | None = None
    sticky_user: bool = False
    max_attempts: int = 3
    connect_timeout: float = 2.0
    first_token_timeout: float = 60.0
    request_timeout: float = 600.0
    validate: bool = True
    api_key: str | None = None
    discover: str | None = None  # HOST:PORT resolved every few seconds (a Kubernetes headless Service)
    # KV-cache events (kv-events policy, and weighted when given): replica URL -> its ZeroMQ endpoint (and replay
    # endpoint), or for replicas without one, the port on the replica's own host
    kv_events_endpoints: dict[str, str] = field(default_factory=dict)
    kv_events_replay_endpoints: dict[str, str] = field(default_factory=dict)
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_topic: str = ""

    @property
    def remembers_sent(self) -> bool:
        """Prefix-aware routing without KV events: each replica's cache is guessed from the prompts sent there."""
        return self.policy == "prefix" or (self.policy == "weighted" and not self.uses_kv_events)

    @property
    def uses_kv_events(self) -> bool:
        return self.policy == "kv-events" or (
            self.policy == "weighted" and bool(self.kv_events_endpoints or self.kv_events_port)
        )


def make_policy(cfg: RouterConfig, pool: Pool, index: KVIndex | None):
    kind = POLICIES[cfg.policy]
    if cfg.policy == "prefix":
        return kind(pool, cfg.balance_margin)
    if cfg.policy == "kv-events":
        return kind(pool, index, cfg.balance_margin)
    if cfg.policy == "weighted":
        return kind(pool, cfg.prefix_weight, cfg.load_weight, index)
    return kind(pool)


def _on_host(url: str, port: int | None) -> str | None:
    if port is None:
        return None
    host = urlsplit(url).hostname
    return f"tcp://[{host}]:{port}" if host and ":" in host else f"tcp://{host}:{port}"


class Router:
    def __init__(self, pool: Pool, cfg: RouterConfig):
        self.pool, self.cfg = pool, cfg
        self.kv_index = KVIndex() if cfg.uses_kv_events else None
        self.subscriptions = Subscriptions(self.kv_index) if self.kv_index is not None else None
        self.policy = make_policy(cfg, pool, self.kv_index)
        self.tokenizer = PromptTokenizer(cfg.model) if cfg.policy in NEEDS_TOKENS else None
        self.remembers = cfg.remembers_sent
        self.metrics = RouterMetrics(pool, self.kv_index)
        self.sticky: dict[str, str] = {}
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False)
        if self.subscriptions is not None:
            for r in self.pool.replicas.values():
                self.subscribe(r)
            self.pool.on_add.append(self.subscribe)
            self.pool.on_remove.append(self.subscriptions.remove)
            self.pool.on_failed.append(lambda r: self.kv_index.drop(r.url))  # a failed replica may come back empty
            self.subscriptions.start()
        await self.pool.start()

    def subscribe(self, r: Replica) -> None:
        endpoint = self.cfg.kv_events_endpoints.get(r.url) or _on_host(r.url, self.cfg.kv_events_port)
        if endpoint is None:
            log.warning("no KV-events endpoint for %s: the kv-events policy sees nothing cached there", r.url)
            return
        replay = self.cfg.kv_events_replay_endpoints.get(r.url) or _on_host(r.url, self.cfg.kv_events_replay_port)
        self.subscriptions.add(Subscriber(self.kv_index, r.url, endpoint, replay, self.cfg.kv_events_topic))

    async def stop(self) -> None:
        await self.pool.stop()
        if self.subscriptions is not None:
            await self.subscriptions.stop()
        if self.session:
            await self.session.close()

    def decide(self, candidates: list[Replica], hashes: Callable, key: str | None) -> Decision:
        if key and (url := self.sticky.get(key)) and any(r.url == url for r in candidates):
            return Decision(next(r for r in candidates if r.url == url), "sticky")
        d = self.policy.choose(candidates, hashes)
        if key:
            self.sticky[key] = d.replica.url
        return d

    def _headers(self, request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}

    async def forward(self, request: Request, path: str, endpoint: str, body: dict, raw: bytes) -> Response:
        stream = bool(body.get("stream"))
        hashes = hasher(self.tokenizer.token_ids(endpoint, body)) if self.tokenizer else (lambda bs: [])
        key = None
        if self.cfg.sticky_header:
            key = request.headers.get(self.cfg.sticky_header)
        if key is None and self.cfg.sticky_user and isinstance(body.get("user"), str):
            key = body["user"]
        tried: set[str] = set()
        last = Failed(503, "no healthy replica is in the pool", False)
        for attempt in range(self.cfg.max_attempts):
            candidates = self.pool.available(exclude=tried)
            if not candidates:
                break
            d = self.decide(candidates, hashes, key)
            r = d.replica
            tried.add(r.url)
            self.metrics.decided(d, retry=attempt > 0)
            if self.remembers:
                r.remember(hashes(r.metrics.block_size or 16))
            r.in_flight += 1
            try:
                return await self._send(r, request, path, raw, stream)
            except Failed as e:
                r.in_flight -= 1
                last = e
                self.metrics.retried(r)
                if e.dead:
                    self.pool.mark_failed(r)
                log.warning("%s on %s failed before its first token (%s); %s", path, r.url, e,
                            "retrying" if attempt + 1 < self.cfg.max_attempts else "giving up")  # fmt: skip
        self.metrics.failed()
        return error(last.status, f"no replica could serve the request: {last}")

    async def _send(self, r: Replica, request: Request, path: str, raw: bytes, stream: bool) -> Response:
        timeout = aiohttp.ClientTimeout(
            total=self.cfg.request_timeout, sock_connect=self.cfg.connect_timeout, sock_read=None
        )
        try:
            resp = await asyncio.wait_for(
                self.session.post(f"{r.url}{path}", data=raw, headers=self._headers(request), timeout=timeout),
                self.cfg.first_token_timeout,
            )
        except (aiohttp.ClientError, OSError) as e:
            raise Failed(502, f"{type(e).__name__}: {e}", dead=True) from None
        except asyncio.TimeoutError:
            raise Failed(504, f"no answer in {self.cfg.first_token_timeout:.0f} s", dead=False) from None
        try:
            if resp.status in RETRY_STATUS:
                text = await resp.text()
                raise Failed(
                    resp.status, f"HTTP {resp.status}: {text[:200]}", dead=resp.status >= 500 and resp.status != 503
                )
            if not stream or resp.status != 200 or "text/event-stream" not in resp.headers.get("content-type", ""):
                content = await asyncio.wait_for(resp.read(), self.cfg.request_timeout)
                resp.release()
                r.in_flight -= 1
                self.metrics.served(r)
                return Response(content, status_code=resp.status, media_type=resp.headers.get("content-type"))
            first = await asyncio.wait_for(self._first_event(resp), self.cfg.first_token_timeout)
        except Failed:
            resp.release()
            raise
        except (aiohttp.ClientError, OSError) as e:
            resp.release()
            raise Failed(502, f"{type(e).__name__}: {e}", dead=True) from None
        except asyncio.TimeoutError:
            resp.release()
            raise Failed(504, f"no first token in {self.cfg.first_token_timeout:.0f} s", dead=False) from None
        return StreamingResponse(self._relay(r, resp, first), media_type="text/event-stream")

    async def _first_event(self, resp: aiohttp.ClientResponse) -> bytes:
        buf = b""
        while b"\n\n" not in buf:
            chunk = await resp.content.readany()
            if not chunk:
                raise Failed(502, "the replica closed the stream before its first event", dead=False)
            buf += chunk
        return buf

    async def _relay(self, r: Replica, resp: aiohttp.ClientResponse, first: bytes):
        tail = first[-64:]
        try:
            yield first
            while chunk := await resp.content.readany():
                tail = (tail + chunk)[-64:]
                yield chunk
            if b"[DONE]" not in tail:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
            self.metrics.served(r)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            # tokens already reached the client: no retry, the stream ends with an error event
            log.warning("stream from %s cut after its first token: %s", r.url, e)
            self.metrics.failed(r)
            self.pool.mark_failed(r)
            yield sse_error(502, f"the replica {r.url} failed mid-stream: {type(e).__name__}: {e}")
        finally:
            resp.release()
            r.in_flight -= 1

    async def get(self, path: str, raw: bytes | None = None, headers: dict | None = None) -> Response:
        """A request any replica answers alike (/v1/models, /tokenize): the first healthy one that does."""
        for r in self.pool.available():
            try:
                call = self.session.get if raw is None else functools.partial(self.session.post, data=raw)
                async with call(f"{r.url}{path}", headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    return Response(await resp.read(), resp.status, media_type=resp.headers.get("content-type"))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                self.pool.mark_failed(r)
        return error(503, "no healthy replica is in the pool")

    async def discover(self) -> None:
        """Pool membership from DNS: every address a headless Service resolves to is a replica."""
        host, _, port = self.cfg.discover.rpartition(":")
        while True:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                urls = {f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in (i[4][0] for i in infos)}
                for url in urls - set(self.pool.replicas):
                    self.pool.add(url)
                for url in set(self.pool.replicas) - urls:
                    self.pool.remove(url)
            except OSError as e:
                log.warning("resolving %s: %s", self.cfg.discover, e)
            await asyncio.sleep(5)


class KeyGate:
    """ASGI middleware: the API key on every API route, as the server asks it (health, metrics, the docs and the
    web page stay open). Plain ASGI: Starlette's BaseHTTPMiddleware would pass every proxied chunk through a memory
    stream and a task of its own."""

    def __init__(self, app, key: str | None, ui: bool = True):
        self.app, self.key, self.ui = app, key, ui

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (scope["type"] == "http" and self.key and path not in OPEN_PATHS
                and not (self.ui and web_page.is_page_path(path))):  # fmt: skip
            scheme, _, token = Request(scope).headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token.strip() != self.key:
                return await error(401, "invalid or missing API key")(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(router: Router, autoscaler=None, ui: bool = True) -> FastAPI:
    """`autoscaler` (fulcrum/router/autoscaler.py) runs beside the router and owns the pool's replicas; `ui`: the
    web page at / (its dashboard shows the replicas and the autoscaler's decisions)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(router.discover())] if router.cfg.discover else []
        if autoscaler is not None:
            tasks.append(loop.create_task(autoscaler.run()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if autoscaler is not None:
            await asyncio.to_thread(autoscaler.close)
        await router.stop()

    app = FastAPI(title="fulcrum router", lifespan=lifespan)
    app.state.router = router
    http_errors.install(app)  # the server's error layer: every error in OpenAI's shape, never {"detail": ...}
    app.openapi = lambda: http_errors.openapi_schema(app)

    app.add_middleware(KeyGate, key=router.cfg.api_key, ui=ui)

    async def generate(request: Request, path: str, endpoint: str, schema):
        raw = await request.body()
        try:
            body = json.loads(raw)
            if router.cfg.validate:
                schema.model_validate(body)
        except RecursionError:
            return error(400, "the request body is nested too deeply")
        except (ValueError, ValidationError) as e:
            first = e.errors()[0] if isinstance(e, ValidationError) else None
            where = ".".join(str(x) for x in first["loc"]) if first and first.get("loc") else "request"
            message = f"{where}: {first['msg']}" if first else "the request body is not valid JSON"
            return error(400, message.removeprefix("Value error, "))
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        return await router.forward(request, path, endpoint, body, raw)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", "completions", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "/v1/chat/completions", "chat", ChatCompletionRequest)

    @app.get("/v1/models")
    async def models():
        return await router.get("/v1/models")

    async def any_replica(request: Request, path: str):
        return await router.get(path, await request.body(), router._headers(request))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await any_replica(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await any_replica(request, "/detokenize")

    @app.get("/version")
    async def version():
        return await router.get("/version")

    @app.get("/ping")
    @app.get("/health")
    async def health():
        n = len(router.pool.available())
        return JSONResponse({"healthy_replicas": n}, status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.collect()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/autoscaler/decisions")
    async def scaler_decisions():
        """The autoscaler's scale events, oldest first, with wall-clock times (the page's dashboard lists them)."""
        if autoscaler is None:
            return {"autoscaler": False, "decisions": []}
        offset = time.time() - time.monotonic()
        return {"autoscaler": True, "decisions": [
            {"time": e.at + offset, "from": e.replicas + (-1 if e.kind == "up" else 1), "to": e.replicas,
             "kind": e.kind, "reason": e.reason} for e in autoscaler.events[-100:]]}  # fmt: skip

    if ui:
        web_page.add_routes(app)
    return app
