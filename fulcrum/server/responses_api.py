"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) on the chat path: a request
becomes a chat completion request (instructions, message items, function_call / function_call_output items, tools and
tool_choice, text.format), its answer becomes a response with reasoning, message and function_call output items.
Streamed, the chat chunks become the Responses events (response.created, response.output_item.added, ...
response.output_text.delta, response.function_call_arguments.delta, ... response.completed), each numbered by
`sequence_number`. Responses are kept (unless `store` is false) in a bounded in-memory store, so that
`previous_response_id` continues a conversation: the earlier response's input and output come before the new input."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from fulcrum.errors import InvalidRequestError
from fulcrum.http_errors import error, status_of, validation_message
from fulcrum.protocol import ChatCompletionRequest
from fulcrum.server.limits import json_body

ENDPOINT = "/v1/responses"
STORE_SIZE = 1000  # responses kept for previous_response_id and GET, least recently used dropped first


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request --------------------------------------------------------------------------------------------------


class Strict(BaseModel):
    # unknown fields and values of the wrong JSON type ("4" for 4, true for 1) are a 400, as OpenAI's API
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class TextPart(Strict):
    """input_text (a user's, system's or developer's) or output_text (an assistant's, sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output's: fulcrum makes none
    logprobs: list[Any] | None = None


class InputImagePart(Strict):
    """An image for a vision-language model: a data URL (fulcrum downloads nothing)."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto"] | None = None  # the model's image processor sets the resolution ("low"/"high": a 400)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[TextPart | InputImagePart, Field(discriminator="type")]]
    id: str | None = None  # an earlier output item sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningPart(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier reasoning output sent back: not given to the template again (as a chat client drops the thought)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(v: Any) -> str:
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]
ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None


def parse_request(data: Any) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as e:
        raise invalid(e) from None


TAGS = {"message", "function_call", "function_call_output", "reasoning"}


def _where(loc) -> str:
    """A field's dotted path, without the names pydantic gives a union's branches (str, list[...], a tag)."""
    parts, prev = [], None
    for p in loc:
        branch = isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool") or p[:1].isupper()
                                         or (p in TAGS and isinstance(prev, int)))  # fmt: skip
        if not branch:
            parts.append(str(p))
        prev = p
    return ".".join(parts)


def invalid(e: ValidationError) -> InvalidRequestError:
    """A 400 naming the field: an unknown one as such; of a union's branches, the one that got furthest."""
    errors = e.errors()
    if not errors:
        return InvalidRequestError("the request is invalid")
    unknown = [x for x in errors if x.get("type") == "extra_forbidden"]
    first = max(unknown or errors, key=lambda x: len(x.get("loc", ())))
    where = _where(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return InvalidRequestError(f"unknown field {where!r}: {ENDPOINT} does not take it", param=where)
    cause = (first.get("ctx") or {}).get("error")
    if getattr(cause, "param", None):
        return InvalidRequestError(str(cause), cause.param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequestError(f"{where or 'request'}: {msg}", where or None)


# -- the store ------------------------------------------------------------------------------------------------------


class ResponseStore:
    """Responses by id, least recently used dropped past `size`: each with the input items of its whole conversation
    (the earlier responses' input and output, then its own input), so that the next turn can be built from it."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, context: list[dict]) -> None:
        self.entries[response["id"]] = (response, context)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        entry = self.entries.get(rid)
        if entry is not None:
            self.entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        return self.entries.pop(rid, None) is not None


def store_of(state) -> ResponseStore:
    store = state.__dict__.get("responses_store")
    if store is None:
        store = state.__dict__["responses_store"] = ResponseStore()
    return store


# -- request -> chat ------------------------------------------------------------------------------------------------


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _content(content):
    """A message's content for the chat route: its text, or its text and image parts in order."""
    if isinstance(content, str) or not any(isinstance(p, InputImagePart) for p in content):
        return _text(content)
    return [
        {"type": "image_url", "image_url": {"url": p.image_url}}
        if isinstance(p, InputImagePart)
        else {"type": "text", "text": p.text}
        for p in content
    ]


def to_messages(items: list) -> list[dict]:
    """Chat messages from input items: a function_call joins the assistant turn before it, its output is a tool
    message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def to_chat(req: ResponsesRequest, items: list) -> dict:
    """The chat completion request body this responses request means, given its conversation's input items."""
    messages = to_messages(items)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise InvalidRequestError("input has no message to answer", "input")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]  # fmt: skip
    if isinstance(req.tool_choice, NamedToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequestError("text.format of type json_schema needs a schema", "text.format.schema")
        schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                                          if v is not None}}  # fmt: skip
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# -- chat -> response -----------------------------------------------------------------------------------------------


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"id": rid or new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}  # fmt: skip


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed", mid: str | None = None) -> dict:
    return {"id": mid or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if text is not None else []}  # fmt: skip


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", fid: str | None = None) -> dict:
    return {"id": fid or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def usage_of(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        # cache writes are not counted apart (the prefix cache keeps every prompt's full blocks, free): 0, as the
        # messages route's cache_creation_input_tokens; the field is required by OpenAI's current schema
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }


def response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str, output: list[dict],
                    usage: dict | None) -> dict:  # fmt: skip
    if isinstance(req.tool_choice, NamedToolChoice):
        tool_choice: Any = req.tool_choice.model_dump()
    else:
        tool_choice = req.tool_choice or "auto"
    fmt = req.text.format if req.text else TextFormat(type="text")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": tool_choice,
        "tools": [t.model_dump() for t in req.tools or []],
        "top_p": req.top_p,
        "truncation": "disabled",
        "metadata": req.metadata or {},
        "usage": usage,
    }


def to_output(chat: dict) -> tuple[list[dict], str]:
    """A chat completion's message as output items, and the response's status."""
    choice = chat["choices"][0]
    msg = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output: list[dict] = []
    if msg.get("reasoning_content"):
        output.append(reasoning_item(msg["reasoning_content"]))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not (calls or output):  # an answer, or nothing at all: not a thought cut short
        output.append(message_item(msg.get("content") or "", status))
    for call in calls:
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"] or "{}"))
    return output, status


# -- streaming ------------------------------------------------------------------------------------------------------


class Numbered:
    """Encodes events as SSE, numbering them (errors included) in the order sent."""

    def __init__(self):
        self.n = 0

    def encode(self, event: dict) -> str:
        event = {**event, "sequence_number": self.n}
        self.n += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def encode_error(self, e: BaseException) -> str:
        return self.encode({"type": "error", "code": str(status_of(e)), "message": str(e) or type(e).__name__,
                            "param": getattr(e, "param", None)})  # fmt: skip


async def stream_events(chunks, req: ResponsesRequest, rid: str, created: int, model: str, finished):
    """The Responses events from the chat path's chunks: one output item at a time (a thought, text, each call);
    `finished(response)` is called with the final response before response.completed is sent."""

    def snapshot(status, output, usage=None):
        return response_object(req, rid, created, model, status, output, usage)

    yield {"type": "response.created", "response": snapshot("in_progress", [])}
    yield {"type": "response.in_progress", "response": snapshot("in_progress", [])}
    output: list[dict] = []
    open_item: dict | None = None  # the item being streamed: {"kind", "id", "text"/"call_id","name","arguments"}
    finish, usage = None, None

    def opened(kind: str, **fields) -> tuple[dict, list[dict]]:
        item = {"kind": kind, "id": new_id({"reasoning": "rs", "text": "msg", "call": "fc"}[kind]), **fields}
        index = len(output)
        if kind == "reasoning":
            added = reasoning_item("", "in_progress", item["id"])
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "text":
            added = message_item(None, "in_progress", item["id"])
            part = text_part("")
        else:
            added = call_item(item["call_id"], item["name"], "", "in_progress", item["id"])
            part = None
        events = [{"type": "response.output_item.added", "output_index": index, "item": added}]
        if part is not None:
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": part})  # fmt: skip
        return item, events

    def closed(item: dict, status: str = "completed") -> list[dict]:
        index, iid = len(output), item["id"]
        where = {"item_id": iid, "output_index": index}
        if item["kind"] == "call":
            done = call_item(item["call_id"], item["name"], item["arguments"] or "{}", "completed", iid)
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": done["arguments"]}]  # fmt: skip
        elif item["kind"] == "reasoning":
            done = reasoning_item(item["text"], "completed", iid)
            part = done["content"][0]
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": item["text"]},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]  # fmt: skip
        else:
            done = message_item(item["text"], status, iid)
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": item["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0,
                       "part": text_part(item["text"])}]  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": index, "item": done})
        output.append(done)
        return events

    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            for kind, text in (("reasoning", delta.reasoning_content), ("text", delta.content)):
                if not text:
                    continue
                if open_item is None or open_item["kind"] != kind:
                    if open_item is not None:
                        for e in closed(open_item):
                            yield e
                    open_item, events = opened(kind, text="")
                    for e in events:
                        yield e
                open_item["text"] += text
                kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
                event = {"type": f"response.{kind_name}.delta", "item_id": open_item["id"],
                         "output_index": len(output), "content_index": 0, "delta": text}  # fmt: skip
                if kind == "text":
                    event["logprobs"] = []
                yield event
            for call in delta.tool_calls or []:
                if call.id is not None or open_item is None or open_item["kind"] != "call":
                    if open_item is not None:
                        for e in closed(open_item):
                            yield e
                    open_item, events = opened("call", call_id=call.id or new_id("call"),
                                               name=call.function.name or "", arguments="")  # fmt: skip
                    for e in events:
                        yield e
                if call.function.arguments:
                    open_item["arguments"] += call.function.arguments
                    yield {"type": "response.function_call_arguments.delta", "item_id": open_item["id"],
                           "output_index": len(output), "delta": call.function.arguments}  # fmt: skip
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    status = "incomplete" if finish == "length" else "completed"
    if open_item is None and not output:  # nothing said: an empty message, as the whole answer gives
        open_item, events = opened("text", text="")
        for e in events:
            yield e
    if open_item is not None:
        for e in closed(open_item, status):
            yield e
    response = snapshot(status, output, usage_of(usage))
    finished(response)
    yield {"type": f"response.{status}", "response": response}


# the chat request's fields a 400 may name, as this API calls them
CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def renamed(msg: str, param: str | None) -> tuple[str, str | None]:
    head = (param or "").split(".")[0].split("[")[0]
    if head not in CHAT_NAMES:
        return msg, param
    # a chat message's index is not its input item's (instructions come first, calls join a turn): the field only
    name = CHAT_NAMES[head] if head == "messages" else CHAT_NAMES[head] + param[len(head) :]
    if msg.startswith(param):
        msg = name + msg[len(param) :]
    return msg, name


# -- routes ---------------------------------------------------------------------------------------------------------


async def create_response(state, request: Request):
    from fulcrum.server.chat import create_chat_completion

    data = await json_body(request)
    req = parse_request(data)
    store = store_of(state)
    context: list[dict] = []
    if req.previous_response_id is not None:
        earlier = store.get(req.previous_response_id)
        if earlier is None:
            raise InvalidRequestError(f"previous response {req.previous_response_id!r} not found (not stored, "
                                      "deleted or dropped from the store)", "previous_response_id")  # fmt: skip
        context = [*earlier[1], *earlier[0]["output"]]
    if isinstance(req.input, str):
        context.append({"type": "message", "role": "user", "content": req.input})
    else:
        context += [item.model_dump(by_alias=True, exclude_none=True) for item in req.input]
    try:
        items = ITEMS.validate_python(context)
        chat = ChatCompletionRequest.model_validate(to_chat(req, items))
    except ValidationError as e:
        chat_error = e.title == "ChatCompletionRequest"
        raise InvalidRequestError(*renamed(*validation_message(e))) if chat_error else invalid(e) from None
    rid, created = new_id("resp"), int(time.time())

    def finished(response: dict) -> None:
        if req.store:
            store.put(response, context)

    def stream_as(run, chunks):
        numbered = Numbered()
        events = stream_events(chunks, req, rid, created, (state.check_model(req.model) or state.model_name), finished)
        return run.stream(events, encode=numbered.encode, encode_error=numbered.encode_error, done="")

    answer = await create_chat_completion(state, chat, request, stream_as)
    if req.stream or not hasattr(answer, "model_dump"):
        return answer  # the stream, or the client went away
    chat_answer = answer.model_dump()
    output, status = to_output(chat_answer)
    response = response_object(
        req,
        rid,
        created,
        (state.check_model(req.model) or state.model_name),
        status,
        output,
        usage_of(chat_answer["usage"]),
    )
    finished(response)
    return response


def not_found(rid: str):
    return error(404, f"no stored response with id {rid!r}", "response_id")


async def get_response(state, rid: str):
    entry = store_of(state).get(rid)
    return entry[0] if entry is not None else not_found(rid)


async def delete_response(state, rid: str):
    if not store_of(state).delete(rid):
        return not_found(rid)
    return {"id": rid, "object": "response", "deleted": True}
