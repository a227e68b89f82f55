"""POST /v1/chat/completions: messages through the model's chat template, n samples, streamed or whole."""

from __future__ import annotations

from fastapi import Request

from fulcrum.errors import InvalidRequestError
from fulcrum.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    random_id,
)
from fulcrum.server.logprobs import chat_logprobs, prompt_logprobs
from fulcrum.server.state import ServerState, sampling_params
from fulcrum.server.streaming import Run, merged, usage_of


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    state.check_model(req.model)
    if req.stream and req.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs is not supported with stream", param="prompt_logprobs")
    tok = state.engine.tokenizer
    ids = state.chat_ids(req.messages, req.add_generation_prompt)
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, req.max_completion_tokens or req.max_tokens, k, req.prompt_logprobs)
    run = await Run.start(merged(state.engine, [(None, ids)], params, req.priority))
    rid = random_id("chatcmpl")

    if req.stream:

        def chunk(choices, usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, model=state.model_name, choices=choices, usage=usage)

        async def events():
            for j in range(req.n):
                yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
            sent: dict[int, int] = {}  # sample -> tokens already streamed
            ro = None
            async for _, ro, deltas in run.items():
                for j, delta in deltas.items():
                    out, done = ro.outputs[j], sent.get(j, 0)
                    lp = chat_logprobs(tok, out.token_ids[done:], out.logprobs[done:], k) if k is not None else None
                    sent[j] = len(out.token_ids)
                    delta_msg = DeltaMessage(content=delta)
                    yield chunk(
                        [ChatStreamChoice(index=j, delta=delta_msg, logprobs=lp, finish_reason=out.finish_reason)]
                    )
            if req.stream_options and req.stream_options.include_usage and ro is not None:
                yield chunk([], usage_of([ro]))

        return run.stream(events())

    last = await run.collect(request)
    if not isinstance(last, dict):
        return last  # the client went away
    ro = last[0]
    choices = [
        ChatChoice(
            index=j,
            message=ChatResponseMessage(content=out.text),
            logprobs=chat_logprobs(tok, out.token_ids, out.logprobs, k) if k is not None else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        for j, out in enumerate(ro.outputs)
    ]
    return ChatCompletionResponse(
        id=rid,
        model=state.model_name,
        choices=choices,
        usage=usage_of([ro]),
        prompt_logprobs=prompt_logprobs(tok, ro.prompt_logprobs) if req.prompt_logprobs is not None else None,
    )
