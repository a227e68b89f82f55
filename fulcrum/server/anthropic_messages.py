"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat path: a request becomes a
chat completion request (system, text and tool_use/tool_result blocks, tools and tool_choice, stop_sequences,
thinking), its answer becomes a message with text, thinking and tool_use blocks; errors take Anthropic's shape on
these routes. Streamed, the chat chunks become Anthropic's events: message_start, a content block per thought, text
and tool call (content_block_start / _delta / _stop), message_delta with the stop reason and usage, message_stop."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fulcrum.errors import InvalidRequestError
from fulcrum.http_errors import status_of, validation_message
from fulcrum.protocol import ChatCompletionRequest, random_id
from fulcrum.server.limits import json_body

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def error(status: int, message: str) -> JSONResponse:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status)


def error_of(e: BaseException) -> JSONResponse:
    return error(status_of(e), str(e) or type(e).__name__)


class Strict(BaseModel):
    # as Anthropic's API: unknown fields and values of the wrong JSON type ("4" for 4, true for 1) are a 400
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # a prompt-caching hint: fulcrum's prefix cache needs none


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ImageSource(Strict):
    type: Literal["base64"]  # fulcrum downloads nothing: a "url" source is a 400
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class ImageBlock(Strict):
    """An image for a vision-language model: the chat route's image_url part as a data URL."""

    type: Literal["image"]
    source: ImageSource
    cache_control: dict | None = None


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None  # a user id, for Anthropic's abuse tracking: changes nothing here


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_chat(req: CountTokensRequest, reasoning: bool) -> dict:
    """The chat completion request body this messages request means."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, calls, parts = [], [], []  # parts: the text and images in order, when there are images
        for b in m.content:
            if isinstance(b, TextBlock):
                text.append(b.text)
                parts.append({"type": "text", "text": b.text})
            elif isinstance(b, ImageBlock):
                url = f"data:{b.source.media_type};base64,{b.source.data}"
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise InvalidRequestError("tool_use blocks are the assistant's", "messages")
                args = json.dumps(b.input)
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}})
            elif isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise InvalidRequestError("tool_result blocks are the user's", "messages")
                result = _text(b.content)
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": f"Error: {result}" if b.is_error else result})  # fmt: skip
            # a thinking block of an earlier turn is not sent back to the template (as Claude's API drops it)
        images = any(p["type"] == "image_url" for p in parts)
        if text or calls or images:
            msg: dict[str, Any] = {"role": m.role, "content": parts if images else "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    body: dict[str, Any] = {"messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequestError("tool_choice of type tool needs a name", "tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        if req.thinking.type == "enabled" and not reasoning:
            raise InvalidRequestError("thinking needs a reasoning model: start the server with --reasoning-parser",
                                      "thinking")  # fmt: skip
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    return body


def sampling_fields(req: MessagesRequest) -> dict:
    out: dict[str, Any] = {"max_tokens": req.max_tokens}
    if req.stop_sequences:
        out["stop"] = req.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            out[name] = getattr(req, name)
    return out


def to_message(chat: dict, model: str, stop_sequences: list[str] | None) -> dict:
    """A chat completion response as Anthropic's message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})  # fmt: skip
    stop_reason, stop_sequence = STOP_REASONS.get(choice["finish_reason"], "end_turn"), None
    if msg.get("tool_calls"):  # OpenAI says "stop" for a forced (named) call; Anthropic says tool_use for any
        stop_reason = "tool_use"
    if isinstance(choice.get("stop_reason"), str) and choice["stop_reason"] in (stop_sequences or []):
        stop_reason, stop_sequence = "stop_sequence", choice["stop_reason"]
    usage = chat["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "id": random_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        },  # fmt: skip
    }


def event_sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def error_sse(e: BaseException) -> str:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status_of(e), "api_error"), "message": str(e)}}
    return event_sse(body)


async def stream_events(chunks, model: str, stop_sequences: list[str] | None):
    """Anthropic's stream events from the chat path's chunks: one content block at a time, a thought's deltas,
    then text's, then each tool call (complete when the chat parser releases it) as a tool_use block."""
    yield {"type": "message_start", "message": {
        "id": random_id("msg"), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}  # fmt: skip
    index, open_kind = -1, None  # the block being streamed
    finish, stop_reason, usage, called = None, None, None, False

    def close():
        return {"type": "content_block_stop", "index": index}

    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            for kind, text in (("thinking", delta.reasoning_content), ("text", delta.content)):
                if not text:
                    continue
                if open_kind != kind:
                    if open_kind is not None:
                        yield close()
                    index, open_kind = index + 1, kind
                    block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
                        "type": "text", "text": ""}  # fmt: skip
                    yield {"type": "content_block_start", "index": index, "content_block": block}
                piece = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {
                    "type": "text_delta", "text": text}  # fmt: skip
                yield {"type": "content_block_delta", "index": index, "delta": piece}
            for call in delta.tool_calls or []:
                if open_kind is not None:
                    yield close()
                index, open_kind, called = index + 1, None, True
                start = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                yield {"type": "content_block_start", "index": index, "content_block": start}
                piece = {"type": "input_json_delta", "partial_json": call.function.arguments or "{}"}
                yield {"type": "content_block_delta", "index": index, "delta": piece}
                yield close()
            if choice.finish_reason is not None:
                finish, stop_reason = choice.finish_reason, getattr(choice, "stop_reason", None)
    if open_kind is not None:
        yield close()
    reason, sequence = STOP_REASONS.get(finish, "end_turn"), None
    if called:
        reason = "tool_use"
    elif isinstance(stop_reason, str) and stop_reason in (stop_sequences or []):
        reason, sequence = "stop_sequence", stop_reason
    out = {"output_tokens": usage.completion_tokens if usage else 0}
    if usage is not None:
        cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
        out.update(input_tokens=usage.prompt_tokens - cached, cache_read_input_tokens=cached)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": out}
    yield {"type": "message_stop"}


def chat_request(body: dict) -> ChatCompletionRequest:
    """The chat request, or a 400 naming the field as this API calls it (stop_sequences, not the chat path's stop)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e)
        if param is not None and param.split(".")[0].split("[")[0] == "stop" and msg.startswith("stop"):
            msg = "stop_sequences" + msg.removeprefix("stop")
        raise InvalidRequestError(msg) from None


async def _body(request: Request, model) -> BaseModel:
    data = await json_body(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequestError(f"{where}: {first.get('msg')}" if where else first.get("msg"), where) from None


async def create_message(state, request: Request):
    from fulcrum.server.chat import create_chat_completion

    try:
        req = await _body(request, MessagesRequest)
        body = {**to_chat(req, state.reasoning_parser is not None), **sampling_fields(req), "model": req.model}
        if req.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        chat = chat_request(body)

        def stream_as(run, chunks):
            events = stream_events(chunks, (state.check_model(req.model) or state.model_name), req.stop_sequences)
            return run.stream(events, encode=event_sse, encode_error=error_sse, done="")

        response = await create_chat_completion(state, chat, request, stream_as)
        if req.stream:
            return response
        if not hasattr(response, "model_dump"):
            return response  # the client went away
        return to_message(response.model_dump(), (state.check_model(req.model) or state.model_name), req.stop_sequences)
    except Exception as e:
        return error_of(e)


async def count_tokens(state, request: Request):
    try:
        req = await _body(request, CountTokensRequest)
        state.check_model(req.model)
        chat = chat_request({**to_chat(req, state.reasoning_parser is not None), "model": req.model})
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        ids = state.chat_ids(chat.messages, True, tools, chat.chat_template_kwargs)
        return {"input_tokens": len(ids)}
    except Exception as e:
        return error_of(e)
