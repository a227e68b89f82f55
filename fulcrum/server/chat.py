"""POST /v1/chat/completions: messages through the model's chat template, n samples, streamed or whole."""

from __future__ import annotations

from dataclasses import replace

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
from fulcrum.server.limits import off_loop
from fulcrum.server.logprobs import chat_logprobs, prompt_logprobs
from fulcrum.server.reasoning import KEEPS_SPECIAL_TOKENS, make_parser
from fulcrum.server.stages import StageClock
from fulcrum.server.state import ServerState, sampling_params
from fulcrum.server.streaming import StartedRequest, check_kv_transfer_request, generate_prompts, usage_of
from fulcrum.server.tools import ToolCalling, delta_calls, response_calls


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request, stream_as=None):
    """The chat completion, whole or streamed as SSE; `stream_as` (another API on this path, such as Anthropic's
    messages): a function of the chunk events that returns the response to stream instead."""
    clock = StageClock(request, state.metrics.frontend)
    clock.mark("receive")
    lora_name = state.check_model(req.model)
    tok = state.engine.tokenizer
    tools = ToolCalling.of(req, state.tool_call_parser)
    ids, images = await off_loop(
        state.chat_prompt, req.messages, req.add_generation_prompt, tools.tools if tools else None,
        req.chat_template_kwargs,
    )  # fmt: skip
    clock.mark("tokenize")
    # a reasoning model's thought goes to reasoning_content; the rendered prompt's tail says if a block is open
    prompt_tail = tok.decode(ids[-8:]) if state.reasoning_parser else ""

    def reasoner():
        return make_parser(state.reasoning_parser, prompt_tail) if state.reasoning_parser else None

    k = (req.top_logprobs or 0) if req.logprobs else None
    # off the event loop: checking a grammar builds it
    params = await off_loop(sampling_params, req, req.max_completion_tokens or req.max_tokens, k, req.prompt_logprobs)
    if tools is not None:
        grammar = await off_loop(tools.grammar)
        if grammar is not None and params.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice required or a named function cannot be combined with another output constraint",
                param="tool_choice",
            )
        params = replace(
            params,
            structured_outputs=grammar or params.structured_outputs,
            skip_special_tokens=params.skip_special_tokens and tools.skip_special_tokens,
        )
    if state.reasoning_parser in KEEPS_SPECIAL_TOKENS:  # the parser reads the format's tags, special tokens
        params = replace(params, skip_special_tokens=False)
    check_kv_transfer_request(req.kv_transfer_params, 1, req.stream)
    clock.mark("params")
    timer = state.metrics.stream_timer(clock.arrival) if req.stream else None
    run = await StartedRequest.start(
        generate_prompts(state.engine, [(None, ids)], params, req.priority, req.kv_transfer_params, lora_name,
                         clock.arrival, images, timer),
        timer,
    )  # fmt: skip
    rid = random_id("chatcmpl")

    if req.stream:

        def chunk(choices, usage=None, prompt_lp=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=rid, model=lora_name or state.model_name, choices=choices, usage=usage, prompt_logprobs=prompt_lp
            )

        async def events():
            for j in range(req.n):
                yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
            sent: dict[int, int] = {}  # sample -> tokens already streamed
            parsers = {j: tools.parser() for j in range(req.n)} if tools else {}
            thoughts = {j: reasoner() for j in range(req.n)}
            calls: dict[int, int] = {}  # sample -> tool calls streamed
            prompt_sent = False
            ro = None
            async for _, ro, deltas in run.items():
                for j, delta in deltas.items():
                    out, done = ro.outputs[j], sent.get(j, 0)
                    lp = chat_logprobs(tok, out.token_ids[done:], out.logprobs[done:], k) if k is not None else None
                    sent[j] = len(out.token_ids)
                    finish = out.finish_reason
                    reasoning = None
                    if thoughts[j] is not None:
                        split = thoughts[j].feed(delta)
                        if finish is not None:
                            end = thoughts[j].finish()
                            split.reasoning = (split.reasoning or "") + (end.reasoning or "") or None
                            split.content = (split.content or "") + (end.content or "") or None
                        reasoning, delta = split.reasoning, split.content or ""
                    if tools is None:
                        if (
                            thoughts[j] is not None
                            and not delta
                            and reasoning is None
                            and finish is None
                            and lp is None
                        ):
                            continue  # text held back: it may start or end the thought
                        delta_msg = DeltaMessage(content=delta if delta or reasoning is None else None,
                                                 reasoning_content=reasoning)  # fmt: skip
                    else:
                        piece = parsers[j].feed(delta)
                        if finish is not None:
                            end = parsers[j].finish()
                            piece.content = (piece.content or "") + (end.content or "") or None
                            piece.tool_calls += end.tool_calls
                        calls[j] = calls.get(j, 0) + sum(d.id is not None for d in piece.tool_calls)
                        finish = tools.finish_reason(calls[j], finish)
                        if (piece.content is None and not piece.tool_calls and reasoning is None and finish is None
                                and lp is None):  # fmt: skip
                            continue  # text held back: it may start a call
                        delta_msg = DeltaMessage(
                            content=piece.content, tool_calls=delta_calls(piece), reasoning_content=reasoning
                        )
                    prompt_lp = None
                    if req.prompt_logprobs is not None and not prompt_sent:  # with the first chunk of text
                        prompt_lp, prompt_sent = prompt_logprobs(tok, ro.prompt_logprobs), True
                    stop = out.stop_reason if finish is not None else None
                    choice = ChatStreamChoice(
                        index=j, delta=delta_msg, logprobs=lp, finish_reason=finish, stop_reason=stop
                    )
                    yield chunk([choice], None, prompt_lp)
            if req.stream_options and req.stream_options.include_usage and ro is not None:
                yield chunk([], usage_of([ro]))

        return stream_as(run, events()) if stream_as is not None else run.stream(events())

    last = await run.collect(request)
    if not isinstance(last, dict):
        return last  # the client went away
    ro = last[0]
    choices = []
    for j, out in enumerate(ro.outputs):
        text, reasoning = out.text, None
        if state.reasoning_parser:
            split = reasoner().split(out.text)
            text, reasoning = split.content or "", split.reasoning
        message, finish = ChatResponseMessage(content=text, reasoning_content=reasoning), out.finish_reason
        if reasoning is not None and not text:
            message.content = None  # all thought (cut by max_tokens): no answer yet
        if tools is not None:
            extracted = tools.parser().extract(text)
            message = ChatResponseMessage(
                content=extracted.content, tool_calls=response_calls(extracted) or None, reasoning_content=reasoning
            )
            finish = tools.finish_reason(len(extracted.tool_calls), finish)
        choices.append(
            ChatChoice(
                index=j,
                message=message,
                logprobs=chat_logprobs(tok, out.token_ids, out.logprobs, k) if k is not None else None,
                finish_reason=finish,
                stop_reason=out.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=rid,
        model=lora_name or state.model_name,
        choices=choices,
        usage=usage_of([ro]),
        prompt_logprobs=prompt_logprobs(tok, ro.prompt_logprobs) if req.prompt_logprobs is not None else None,
        kv_transfer_params=ro.kv_transfer_params,
    )
