"""The OpenAI-compatible HTTP app: routes over the AsyncLLM frontend, the checks every request passes
first (key, shutdown, media type), and the plain endpoints. The two generating endpoints live in
completions.py and chat.py."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import fulcrum
from fulcrum import http_errors as errors
from fulcrum.engine.request import check_token_ids
from fulcrum.errors import ShuttingDownError
from fulcrum.http_errors import ERROR_RESPONSES, error, error_of
from fulcrum.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from fulcrum.server import anthropic_messages, embeddings, lora_routes, responses_api
from fulcrum.server.chat import create_chat_completion
from fulcrum.server.completions import create_completion
from fulcrum.server.limits import BodyLimit, off_loop
from fulcrum.server.stages import StampArrival
from fulcrum.server.state import ServerState
from fulcrum.utils import web_page

OPEN_PATHS = {"/health", "/metrics", "/version", "/ping", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}


def is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def authorized(request: Request, api_key: str) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (scheme.lower() == "bearer" and token.strip() == api_key) or request.headers.get("x-api-key") == api_key


class Gate:
    """ASGI middleware: the checks every API request passes before its body is read (key, shutdown, media type);
    the web page's files (`ui`) are open, as the page asks for the key itself. Plain ASGI, not Starlette's
    BaseHTTPMiddleware, which passes every streamed chunk through a memory stream and a task switch of its own."""

    def __init__(self, app, state: ServerState, ui: bool = True):
        self.app, self.state, self.ui = app, state, ui

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in OPEN_PATHS and not (self.ui and web_page.is_page_path(path)):
            refusal = self.refusal(Request(scope))
            if refusal is not None:
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, request: Request) -> Response | None:
        state = self.state
        if state.api_key and not authorized(request, state.api_key):
            if request.url.path.startswith("/v1/messages"):
                return anthropic_messages.error(401, "invalid or missing API key")
            return error(401, "invalid or missing API key")
        if state.draining:
            return error_of(ShuttingDownError("the server is shutting down; retry on another replica"))
        content_type = request.headers.get("content-type")
        if request.method == "POST" and content_type and not is_json(content_type):
            return error(415, f"the request body must be application/json, not {content_type!r}")
        return None


def build_app(state: ServerState, ui: bool = True) -> FastAPI:
    """`ui`: the web page at / (fulcrum/server/ui/); `fulcrum serve --no-ui` leaves it out."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine.ready is None:
            await state.engine.start()
        state.engine.stat_loggers.append(state.metrics)
        yield
        await state.engine.shutdown()

    app = FastAPI(title="fulcrum", version=fulcrum.__version__, lifespan=lifespan)
    app.state.fulcrum = state
    errors.install(app)
    app.openapi = lambda: errors.openapi_schema(app)

    app.add_middleware(BodyLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(Gate, state=state, ui=ui)  # before the body is read
    app.add_middleware(StampArrival)  # outside the body's reading: the clocks start when the request arrives
    if state.allowed_origins:  # added last, so outermost: a browser's preflight carries no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=state.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(state, req, request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES},
    )
    async def chat(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, req, request)

    @app.post("/v1/messages", response_model=None)
    async def messages(request: Request):
        """Anthropic's Messages API (fulcrum/server/anthropic_messages.py)."""
        return await anthropic_messages.create_message(state, request)

    @app.post("/v1/messages/count_tokens", response_model=None)
    async def messages_count_tokens(request: Request):
        return await anthropic_messages.count_tokens(state, request)

    @app.post("/v1/responses", response_model=None, responses=ERROR_RESPONSES)
    async def responses(request: Request):
        """OpenAI's Responses API (fulcrum/server/responses_api.py)."""
        return await responses_api.create_response(state, request)

    @app.get("/v1/responses/{response_id}", response_model=None, responses=ERROR_RESPONSES)
    async def get_response(response_id: str):
        return await responses_api.get_response(state, response_id)

    @app.delete("/v1/responses/{response_id}", response_model=None, responses=ERROR_RESPONSES)
    async def delete_response(response_id: str):
        return await responses_api.delete_response(state, response_id)

    @app.post("/v1/embeddings", response_model=None, responses=ERROR_RESPONSES)
    async def create_embeddings(request: Request):
        """OpenAI's embeddings, from an embedding model (fulcrum/server/embeddings.py)."""
        return await embeddings.create_embedding(state, request)

    lora_routes.add(app, state)
    if ui:  # the page loads without the key; it asks for the key and sends it on its API calls
        web_page.add_routes(app)  # vLLM's load/unload routes, when runtime updating is allowed

    @app.get("/health", responses={503: {"description": "the engine is not running, or the server is draining"}})
    async def health():
        if not state.engine.healthy:
            return JSONResponse({"status": "unhealthy", "reason": "the engine is not running"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", "reason": "the server is shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ping", responses={503: {"description": "as /health"}})
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": fulcrum.__version__}

    @app.get("/metrics")
    async def metrics():
        # the frontend also counts requests sent but not yet seen by the core: the gauge shows what admission sees
        state.metrics.waiting.set(state.engine.num_waiting())
        cores = state.engine.client.cores
        state.metrics.record_engines([c.given for c in cores], [c.stats.num_running for c in cores])
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
    async def models():
        max_len = state.engine.ready.max_model_len
        card = ModelCard(id=state.model_name, root=str(state.engine.model_path), max_model_len=max_len)
        adapters = [ModelCard(id=name, root=path, parent=state.model_name, max_model_len=max_len)
                    for name, path in state.loras.items()]  # fmt: skip
        return ModelList(data=[card, *adapters])

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]},
    )
    async def model(model_id: str):
        state.check_model(model_id)
        return {c.id: c for c in (await models()).data}[model_id]

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if req.messages is not None:
            ids = await off_loop(state.chat_ids, req.messages, req.add_generation_prompt)
        else:
            encode = state.engine.tokenizer
            ids = (await off_loop(lambda: encode(req.prompt, add_special_tokens=req.add_special_tokens)))["input_ids"]
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.ready.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        check_token_ids("tokens", req.tokens, state.engine.ready.vocab_size)
        return DetokenizeResponse(prompt=state.engine.tokenizer.decode(req.tokens))

    return app
