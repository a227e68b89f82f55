"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncLLM frontend."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import fulcrum
from fulcrum.engine.async_llm import AsyncLLM
from fulcrum.errors import InvalidRequestError, ShuttingDownError
from fulcrum.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    random_id,
)
from fulcrum.sampling_params import SamplingParams
from fulcrum.server import errors
from fulcrum.server.errors import ERROR_RESPONSES, error, error_of, sse_error, status_of
from fulcrum.server.metrics import ServerMetrics

log = logging.getLogger("fulcrum.server")
OPEN_PATHS = {"/health", "/metrics", "/version", "/ping", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}


@dataclass
class ServerState:
    engine: AsyncLLM
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    draining: bool = False  # SIGTERM: requests in flight finish, new ones get 503


def is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def authorized(header: str, api_key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and token.strip() == api_key


def build_app(state: ServerState) -> FastAPI:
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

    @app.middleware("http")
    async def gate(request: Request, call_next):
        """Checks every API request passes before its body is read: key, shutdown, media type."""
        path = request.url.path
        if path not in OPEN_PATHS:
            if state.api_key and not authorized(request.headers.get("authorization", ""), state.api_key):
                return error(401, "invalid or missing API key")
            if state.draining:
                return error_of(ShuttingDownError("the server is shutting down; retry on another replica"))
            content_type = request.headers.get("content-type")
            if request.method == "POST" and content_type and not is_json(content_type):
                return error(415, f"the request body must be application/json, not {content_type!r}")
        return await call_next(request)

    # -- plain endpoints -------------------------------------------------------------------------

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
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
    async def models():
        card = ModelCard(
            id=state.model_name,
            root=str(state.engine.model_config.path),
            max_model_len=state.engine.ready.max_model_len,
        )
        return ModelList(data=[card]).model_dump()

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(req: TokenizeRequest):
        if (resp := check_model(req.model)) is not None:
            return resp
        tok = state.engine.tokenizer
        if req.messages is not None:
            ids = chat_ids(req.messages, req.add_generation_prompt)
        else:
            ids = tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.ready.max_model_len, tokens=ids)

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(req: DetokenizeRequest):
        if (resp := check_model(req.model)) is not None:
            return resp
        vocab = state.engine.ready.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=state.engine.tokenizer.decode(req.tokens))

    # -- helpers -----------------------------------------------------------------------------------

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name != state.model_name:
            return error(404, f"The model `{name}` does not exist.", "model")
        return None

    def chat_ids(messages, add_generation_prompt=True) -> list[int]:
        try:
            convo = [{"role": m.role, "content": m.text()} for m in messages]
            ids = state.engine.tokenizer.apply_chat_template(
                convo, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        except Exception as e:  # template errors (e.g. a role the template refuses) are the client's
            raise InvalidRequestError(f"messages cannot be rendered by the chat template: {e}", "messages") from e
        return list(ids)

    def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        return SamplingParams(
            n=req.n,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty or 1.0,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias_of(req),
        )

    def logit_bias_of(req: SamplingFields) -> dict[int, float] | None:
        try:
            return req.logit_bias_ids()
        except ValueError as e:
            raise InvalidRequestError(str(e), param="logit_bias") from e

    async def merged(
        prompts: list[tuple[str | None, list[int]]], params: SamplingParams, priority: int
    ) -> AsyncIterator[tuple[int, object, dict[int, str]]]:
        """Run every prompt concurrently; yield (prompt index, output, deltas) as steps land.
        Generators are created (and validated) before the first yield, so errors come out as 400s."""
        gens = [state.engine.generate(p, ids, params, priority=priority) for p, ids in prompts]
        if len(gens) == 1:
            async for ro, deltas in gens[0]:
                yield 0, ro, deltas
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for ro, deltas in gen:
                    await queue.put((i, ro, deltas))
            except Exception as e:
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def first_item(it: AsyncIterator):
        """Start an iterator so that validation errors raise before any response is sent."""
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return None

    async def until_disconnect(request: Request, coro):
        """Run `coro`; if the client goes away first, cancel it (which aborts its requests)."""
        task = asyncio.ensure_future(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def sse_response(events: AsyncIterator[str], it: AsyncIterator) -> StreamingResponse:
        """Stream `events`, then `[DONE]`; a failure (engine, request, shutdown) ends the stream with an error
        event and then `[DONE]`, and however it ends (a client gone included) the request iterator `it` is
        closed, aborting its requests."""

        async def body():
            try:
                async for event in events:
                    yield event
            except Exception as e:
                if status_of(e) >= 500 and not isinstance(e, ShuttingDownError):
                    log.error("stream failed: %s: %s", type(e).__name__, e)
                yield sse_error(e)
            finally:
                await it.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def prompts_of(req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        tok = state.engine.tokenizer
        if isinstance(p, str):
            return [(p, tok(p)["input_ids"])]
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]
        out = []
        for x in p:
            if isinstance(x, str):
                out.append((x, tok(x)["input_ids"]))
            else:
                out.append((None, list(x)))
        return out

    def usage_of(outputs) -> UsageInfo:
        """Usage over finished RequestOutputs: each prompt once, every sample's tokens."""
        pt = sum(len(ro.prompt_token_ids) for ro in outputs)
        ct = sum(len(o.token_ids) for ro in outputs for o in ro.outputs)
        return UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    def token_str(tid: int) -> str:
        return state.engine.tokenizer.decode([tid])

    def top_k(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of one step (an entry holds the sampled token and the top k)."""
        return sorted(entry.items(), key=lambda kv: -kv[1])[:k]

    def completion_logprobs(token_ids, logprobs, start_offset: int, k: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        offset = start_offset
        for tid, entry in zip(token_ids, logprobs or []):
            s = token_str(tid)
            lp.tokens.append(s)
            lp.token_logprobs.append(entry.get(tid))
            lp.top_logprobs.append({token_str(t): v for t, v in top_k(entry, k)} or None)
            lp.text_offset.append(offset)
            offset += len(s)
        return lp

    def chat_logprobs(token_ids, logprobs, k: int) -> ChatChoiceLogprobs:
        content = []
        for tid, entry in zip(token_ids, logprobs or []):
            s = token_str(tid)
            top = [
                {"token": token_str(t), "logprob": v, "bytes": list(token_str(t).encode())} for t, v in top_k(entry, k)
            ]
            content.append(ChatLogprobEntry(token=s, logprob=entry.get(tid), bytes=list(s.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    # -- /v1/completions --------------------------------------------------------------------------

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def completions(req: CompletionRequest, request: Request):
        if (resp := check_model(req.model)) is not None:
            return resp
        if req.best_of not in (None, req.n):
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        if req.suffix:
            raise InvalidRequestError("suffix (fill-in-the-middle) is not supported", param="suffix")
        prompts = prompts_of(req)
        params = sampling_params(req, req.max_tokens, req.logprobs)
        rid = random_id("cmpl")
        n = req.n
        it = merged(prompts, params, req.priority)
        first = await first_item(it)
        echo = [(p if p is not None else state.engine.tokenizer.decode(ids)) if req.echo else "" for p, ids in prompts]

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(choices, usage=None) -> str:
                body = {
                    "id": rid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": state.model_name,
                    "choices": choices,
                }
                if usage is not None:
                    body["usage"] = usage.model_dump()
                return sse(body)

            async def stream():
                sent: dict[int, int] = {}  # choice index -> tokens already streamed
                finished = {}  # prompt index -> its final output
                item = first
                while item is not None:
                    i, ro, deltas = item
                    for j, delta in deltas.items():
                        out = ro.outputs[j]
                        idx = i * n + j
                        text = delta if idx in sent else echo[i] + delta
                        done = sent.get(idx, 0)
                        lp = None
                        if req.logprobs is not None:
                            new_ids, new_lps = out.token_ids[done:], out.logprobs[done:]
                            lp = completion_logprobs(new_ids, new_lps, 0, req.logprobs).model_dump()
                        sent[idx] = len(out.token_ids)
                        choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
                        if out.finish_reason:
                            choice["stop_reason"] = out.stop_reason
                        yield chunk([choice])
                    if ro.finished:
                        finished[i] = ro
                    item = await first_item(it)
                if include_usage:
                    yield chunk([], usage_of(finished.values()))

            return sse_response(stream(), it)

        async def collect():
            last = {}
            item = first
            while item is not None:
                i, ro, _ = item
                last[i] = ro
                item = await first_item(it)
            return last

        last = await until_disconnect(request, collect())
        if isinstance(last, Response):
            return last
        choices = []
        for i in range(len(prompts)):
            ro = last[i]
            for j, out in enumerate(ro.outputs):
                lp = (
                    completion_logprobs(out.token_ids, out.logprobs, len(echo[i]), req.logprobs)
                    if req.logprobs is not None
                    else None
                )
                choices.append(
                    CompletionChoice(
                        index=i * n + j,
                        text=echo[i] + out.text,
                        logprobs=lp,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        return CompletionResponse(
            id=rid, model=state.model_name, choices=choices, usage=usage_of(last.values())
        ).model_dump()

    # -- /v1/chat/completions ---------------------------------------------------------------------

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES},
    )
    async def chat(req: ChatCompletionRequest, request: Request):
        if (resp := check_model(req.model)) is not None:
            return resp
        ids = chat_ids(req.messages, req.add_generation_prompt)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, req.max_completion_tokens or req.max_tokens, k)
        rid = random_id("chatcmpl")
        it = merged([(None, ids)], params, req.priority)
        first = await first_item(it)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(choices, usage=None):
                body = ChatCompletionChunk(id=rid, model=state.model_name, choices=choices, usage=usage).model_dump()
                if usage is None:
                    del body["usage"]
                return sse(body)

            async def stream():
                for j in range(req.n):
                    yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
                seen = {}
                item, ro = first, None
                while item is not None:
                    _, ro, deltas = item
                    for j, delta in deltas.items():
                        out = ro.outputs[j]
                        done = seen.get(j, 0)
                        lp = chat_logprobs(out.token_ids[done:], out.logprobs[done:], k) if req.logprobs else None
                        seen[j] = len(out.token_ids)
                        choice = ChatStreamChoice(
                            index=j, delta=DeltaMessage(content=delta), logprobs=lp, finish_reason=out.finish_reason
                        )
                        yield chunk([choice])
                    item = await first_item(it)
                if include_usage and ro is not None:
                    yield chunk([], usage_of([ro]))

            return sse_response(stream(), it)

        async def collect():
            last, item = None, first
            while item is not None:
                last = item[1]
                item = await first_item(it)
            return last

        ro = await until_disconnect(request, collect())
        if isinstance(ro, Response):
            return ro
        choices = [
            ChatChoice(
                index=j,
                message=ChatResponseMessage(content=out.text),
                logprobs=chat_logprobs(out.token_ids, out.logprobs, k) if req.logprobs else None,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for j, out in enumerate(ro.outputs)
        ]
        return ChatCompletionResponse(
            id=rid, model=state.model_name, choices=choices, usage=usage_of([ro])
        ).model_dump()

    return app
