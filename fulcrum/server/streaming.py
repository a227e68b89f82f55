"""The one path both endpoints take from engine outputs to an HTTP answer: run a request's prompts
concurrently, stream their steps as server-sent events, or collect them into one body; a client that
goes away aborts its requests."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from fulcrum.engine.async_llm import AsyncLLM
from fulcrum.engine.multimodal import ImageInput
from fulcrum.engine.outputs import RequestOutput
from fulcrum.errors import InvalidRequestError, ShuttingDownError
from fulcrum.http_errors import sse_error, status_of
from fulcrum.protocol import UsageInfo
from fulcrum.sampling_params import SamplingParams
from fulcrum.server.metrics import StreamTimer

log = logging.getLogger("fulcrum.server")
PromptStep = tuple[int, RequestOutput, dict[int, str]]  # (prompt index, output so far, new text per sample)


async def generate_prompts(
    engine: AsyncLLM,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    priority: int,
    kv_transfer_params: dict | None = None,
    lora_name: str | None = None,
    arrival_time: float | None = None,
    images: ImageInput | None = None,
    timer: StreamTimer | None = None,
) -> AsyncIterator[PromptStep]:
    """Run every prompt concurrently; yield items as steps land. `lora_name`: the LoRA adapter they run with (None:
    the base model); `arrival_time`: when the HTTP request arrived (server/stages.py); `timer`: a streamed
    response's TTFT clock (it names the engine requests)."""
    gens = [engine.generate(p, ids, params, priority=priority, kv_transfer_params=kv_transfer_params,
                            lora_name=lora_name, arrival_time=arrival_time, images=images,
                            request_id=None if timer is None else timer.request_id(i, params.n))
            for i, (p, ids) in enumerate(prompts)]  # fmt: skip
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


def check_kv_transfer_request(params: dict | None, num_prompts: int, stream: bool) -> None:
    """What a P/D handshake takes at the HTTP layer: one prompt; a prefill answered whole (its params ride on the
    response body, as vLLM's)."""
    if params is None:
        return
    if num_prompts != 1:
        raise InvalidRequestError("kv_transfer_params takes one prompt per request", param="kv_transfer_params")
    if params.get("do_remote_decode") and stream:
        raise InvalidRequestError("kv_transfer_params do_remote_decode needs stream false", "kv_transfer_params")


class StartedRequest:
    """A started request: its first item is awaited at once, so that a refusal (a bad value, a full queue)
    raises before any response is sent and becomes a plain error response. `timer` (the one generate_prompts
    took): a streamed response's TTFT clock, stopped as chunks are written."""

    def __init__(self, it: AsyncIterator[PromptStep], timer: StreamTimer | None = None):
        self.it = it
        self.first: PromptStep | None = None
        self.timer = timer
        self.started: set[str] = set()  # the engine requests that have had tokens

    @classmethod
    async def start(cls, it: AsyncIterator[PromptStep], timer: StreamTimer | None = None) -> StartedRequest:
        run = cls(it, timer)
        try:
            run.first = await run._next()
        except BaseException:
            if timer is not None:
                timer.close()
            raise
        return run

    async def _next(self) -> PromptStep | None:
        try:
            item = await self.it.__anext__()
        except StopAsyncIteration:
            return None
        ro = item[1]
        if self.timer is not None and ro.request_id not in self.started and any(o.token_ids for o in ro.outputs):
            self.started.add(ro.request_id)
        return item

    async def items(self) -> AsyncIterator[PromptStep]:
        item = self.first
        while item is not None:
            yield item
            item = await self._next()

    async def last_outputs(self) -> dict[int, RequestOutput]:
        """StartedRequest to the end; each prompt's final output."""
        last = {}
        async for i, ro, _ in self.items():
            last[i] = ro
        return last

    async def collect(self, request: Request) -> dict[int, RequestOutput] | Response:
        """last_outputs(), unless the client goes away first: then its requests are aborted (499)."""
        return await until_done(self.last_outputs(), request)

    def stream(
        self, events: AsyncIterator, encode=None, encode_error=sse_error, done: str = "data: [DONE]\n\n"
    ) -> StreamingResponse:
        """Stream `events` as SSE (`encode`: OpenAI's chunks by default), then `done`; a failure (engine, request,
        shutdown) ends the stream with an error event and then `done`, and however it ends (a client gone
        included) the requests are aborted."""
        encode = encode or sse

        async def body():
            try:
                async for event in events:
                    yield encode(event)
                    if self.timer is not None:  # the chunk is written: the tokens it carries have reached the client
                        self.timer.written(self.started)
            except Exception as e:
                if status_of(e) >= 500 and not isinstance(e, ShuttingDownError):
                    log.error("stream failed: %s: %s", type(e).__name__, e)
                yield encode_error(e)
            finally:
                if self.timer is not None:
                    self.timer.close()
                await self.it.aclose()
            if done:
                yield done

        return StreamingResponse(body(), media_type="text/event-stream")


async def until_done(work, request: Request):
    """What `work` (a coroutine) returns, unless the client goes away first: then it is cancelled (the requests it
    runs are aborted) and the answer is a 499."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)


def sse(event: BaseModel) -> str:
    body = event.model_dump()
    for key in ("usage", "prompt_logprobs"):  # each rides on one chunk only, when the client asked for it
        if body.get(key, 0) is None:
            del body[key]
    for choice in body.get("choices") or []:
        # a tool call's later deltas carry only what they add (as OpenAI and vLLM send them): the openai SDK's
        # stream helper merges each key it sees, so a "type": null would overwrite the call's type
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("tool_calls"):
            delta["tool_calls"] = [_without_nones(call) for call in delta["tool_calls"]]
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _without_nones(d: dict) -> dict:
    return {k: _without_nones(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def usage_of(outputs) -> UsageInfo:
    """Usage over finished RequestOutputs: each prompt once, every sample's tokens, the prompt tokens cached."""
    outputs = list(outputs)
    pt = sum(len(ro.prompt_token_ids) for ro in outputs)
    ct = sum(len(o.token_ids) for ro in outputs for o in ro.outputs)
    cached = sum(ro.metrics.num_cached_tokens for ro in outputs if ro.metrics is not None)
    details = {"cached_tokens": cached}  # prompt tokens taken from the prefix cache
    return UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct, prompt_tokens_details=details)
