"""OpenAI API shapes (requests, responses, stream chunks, errors), one module for server, router and bench.

Request models accept the fields vLLM accepts as extras (top_k, min_p, repetition_penalty, ignore_eos, min_tokens)
and reject unknown roles and out-of-range values with the field named. No request field is silently ignored: one
fulcrum does not implement (set to anything but its default) or does not know is a 400 naming it (REQUEST_FIELDS)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    model_validator,
)

from fulcrum.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# apply_chat_template's own arguments: chat_template_kwargs may not set them
TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "return_dict", "chat_template", "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})  # fmt: skip


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _no_bool(v):
    if isinstance(v, bool):
        raise ValueError("must be an integer, not a boolean")
    return v


# Integers as the engine carries them (int64 in its messages and RNG seeds); JSON `true` is not 1.
Int64 = Annotated[int, BeforeValidator(_no_bool), Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=INT64_MAX)]
NonNegativeInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=INT64_MAX)]
# Token ids: strict integers (no bools, no floats, no strings); the engine checks them against its vocabulary.
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _check_utf8(value: Any, path: str = "") -> None:
    """Lone surrogates (a JSON "\\ud800" escape) are valid Python strings but not UTF-8: the
    tokenizer and the JSON encoder of the response would fail on them, so refuse them here."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{path or 'a string'} is not valid UTF-8 (a lone surrogate at {e.start})", param=path or None
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k, path)
            _check_utf8(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_utf8(v, f"{path}[{i}]")


class OpenAIBase(BaseModel):
    # OpenAI clients send fields we do not use; NaN and Infinity (which Python's JSON reader accepts) are refused
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class RequestBody(OpenAIBase):
    """A whole request body: its strings are checked once here, nested parts (messages, content parts) included."""

    @model_validator(mode="before")
    @classmethod
    def _valid_utf8(cls, data):
        _check_utf8(data)
        return data


# -- which request fields fulcrum implements -------------------------------------------------------

IMPLEMENTED = "implemented"
NO_EFFECT = "accepted: it identifies or labels the request and changes nothing fulcrum computes"
REFUSED = "not supported"


class FieldSupport(NamedTuple):
    status: str
    defaults: tuple = ()  # for a refused field: the values that mean "not asked for", which pass


_IMPL, _NOOP = FieldSupport(IMPLEMENTED), FieldSupport(NO_EFFECT)


def _refused(*defaults) -> FieldSupport:
    return FieldSupport(REFUSED, (None, *defaults))


# Fields both endpoints share: OpenAI's, then vLLM's extras (vllm/entrypoints/openai/protocol.py).
_COMMON = {
    "model": _IMPL,
    "max_tokens": _IMPL,
    "temperature": _IMPL,
    "top_p": _IMPL,
    "n": _IMPL,
    "stop": _IMPL,
    "seed": _IMPL,
    "presence_penalty": _IMPL,
    "frequency_penalty": _IMPL,
    "logit_bias": _IMPL,
    "stream": _IMPL,
    "stream_options": _IMPL,
    "user": _NOOP,
    # vLLM
    "top_k": _IMPL,
    "min_p": _IMPL,
    "repetition_penalty": _IMPL,
    "ignore_eos": _IMPL,
    "min_tokens": _IMPL,
    "stop_token_ids": _IMPL,
    "skip_special_tokens": _IMPL,
    "include_stop_str_in_output": _IMPL,
    "priority": _IMPL,
    "prompt_logprobs": _IMPL,
    "use_beam_search": _refused(False),
    "length_penalty": _refused(1.0, 1),
    "spaces_between_special_tokens": _refused(True),
    "truncate_prompt_tokens": _refused(),
    "allowed_token_ids": _refused(),
    "bad_words": _refused([]),
    "response_format": _IMPL,
    "structured_outputs": _IMPL,
    "guided_json": _IMPL,
    "guided_regex": _IMPL,
    "guided_choice": _IMPL,
    "guided_grammar": _IMPL,
    "structural_tag": _IMPL,
    "guided_decoding_backend": _refused("auto", "xgrammar"),  # the one backend fulcrum has
    "guided_whitespace_pattern": _refused(),
    "logits_processors": _refused(),
    "return_tokens_as_token_ids": _refused(False),
    "return_token_ids": _refused(False),
    "request_id": _refused(),
    "cache_salt": _refused(),
    "kv_transfer_params": _IMPL,  # P/D disaggregation's handshake (fulcrum/engine/kv_transfer)
    "vllm_xargs": _refused(),
}

# every field of OpenAI's and vLLM's request schemas, per endpoint, with what fulcrum does with it (check_fields)
REQUEST_FIELDS: dict[str, dict[str, FieldSupport]] = {
    "/v1/completions": {
        **_COMMON,
        "prompt": _IMPL,
        "echo": _IMPL,
        "logprobs": _IMPL,
        "best_of": _IMPL,  # equal to n (or absent) only: checked by the handler
        "suffix": _refused(""),
        # vLLM
        "add_special_tokens": _refused(True),
        "prompt_embeds": _refused(),
    },
    "/v1/chat/completions": {
        **_COMMON,
        "messages": _IMPL,
        "max_completion_tokens": _IMPL,
        "logprobs": _IMPL,
        "top_logprobs": _IMPL,
        "metadata": _NOOP,
        "service_tier": _refused("auto", "default"),
        "store": _refused(False),
        "tools": _IMPL,
        "tool_choice": _IMPL,
        "parallel_tool_calls": _IMPL,
        "functions": _refused([]),
        "function_call": _refused("none", "auto"),
        "audio": _refused(),
        "modalities": _refused(["text"]),
        "prediction": _refused(),
        "reasoning_effort": _refused(),
        "verbosity": _refused(),
        "web_search_options": _refused(),
        "prompt_cache_key": _NOOP,
        "prompt_cache_retention": _refused(),  # how long OpenAI keeps a prompt's cache; fulcrum's is an LRU
        "prompt_cache_options": _refused(),
        "moderation": _refused(),
        "safety_identifier": _NOOP,
        # vLLM
        "add_generation_prompt": _IMPL,
        "echo": _refused(False),
        "continue_final_message": _refused(False),
        "add_special_tokens": _refused(False),
        "documents": _refused(),
        "chat_template": _refused(),
        "chat_template_kwargs": _IMPL,
        "mm_processor_kwargs": _refused(),
        "best_of": _refused(1),
    },
}


def check_fields(endpoint: str, data) -> None:
    """A 400 naming the first field of `data` fulcrum does not implement (with a value other than its default)
    or does not know at all (OpenAI refuses those too; vLLM only logs them)."""
    if not isinstance(data, dict):
        return
    table = REQUEST_FIELDS[endpoint]
    for name, value in data.items():
        support = table.get(name)
        if support is None:
            raise InvalidRequestError(f"unknown field {name!r}: {endpoint} does not take it", param=name)
        status, defaults = support
        if status == REFUSED and not any(value == d and type(value) is type(d) for d in defaults):
            raise InvalidRequestError(
                f"{name} is not supported by this server (only its default, {_defaults(defaults)}, is accepted)",
                param=name,
            )


def _defaults(defaults) -> str:
    return " or ".join(json.dumps(d) for d in defaults)


# -- errors ---------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- shared pieces --------------------------------------------------------------------------------


class StrictPart(BaseModel):
    """A nested object of a request whose keys fulcrum knows all of: an unknown key is a 400, not ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(StrictPart):
    name: str | None = None  # OpenAI requires it; vLLM does not
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(StrictPart):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type json_schema")
        if self.json_schema is not None and self.json_schema.schema_ is None:
            raise ValueError("json_schema.schema is required")
        return self


class StructuredOutputsFields(StrictPart):
    """vLLM's `structured_outputs` object (engine side: sampling_params.StructuredOutputsParams)."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None  # None: a little whitespace; false: free (engine/structured)


class StreamOptions(OpenAIBase):
    include_usage: bool = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict | None = None


class SamplingFields(RequestBody):
    """Sampling fields common to both endpoints, with vLLM's extras."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=128)] = 1
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: Int64 | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, BeforeValidator(_no_bool), Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=1e6)
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    prompt_logprobs: Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=20)] | None = None
    # token id (as a string, as OpenAI sends it) -> bias in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* fields and structured_outputs object
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    # vLLM's P/D handshake: {"do_remote_decode": true} to a prefill engine; what it answered, to a decode engine
    kv_transfer_params: dict[str, Any] | None = None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with integer keys; a key that is not a token id is the client's error."""
        if not self.logit_bias:
            return None
        out = {}
        for key, v in self.logit_bias.items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            out[int(key)] = v
        return out


# -- completions ----------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        check_fields("/v1/completions", data)
        return data

    # a text, texts, token ids, or lists of token ids; none of them empty
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=20)] | None = None
    echo: bool = False
    max_tokens: NonNegativeInt | None = 16  # 0 with echo: score the prompt, generate nothing
    best_of: Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=128)] | None = None

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
        return self


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's answer to do_remote_decode, as vLLM's


# -- chat -----------------------------------------------------------------------------------------

ROLES = Literal["system", "user", "assistant", "developer", "tool"]


class TextPart(OpenAIBase):
    type: Literal["text"]
    text: str


class ImageUrl(StrictPart):
    url: str  # a data URL (data:image/png;base64,...): fulcrum downloads nothing
    # the model's image processor sets the resolution: OpenAI's "low" and "high" are not implemented (a 400)
    detail: Literal["auto"] | None = None


class ImageUrlPart(OpenAIBase):
    """An image for a vision-language model (engine/multimodal.py)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionDefinition(StrictPart):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # with tool_choice required or a named function the schema is always enforced


class ChatTool(StrictPart):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictPart):
    name: FunctionName


class NamedToolChoice(StrictPart):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(StrictPart):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictPart):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBase):
    role: ROLES
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def for_template(self, image_placeholder: str = "") -> dict:
        """The message as chat templates read it: text content (an image part as `image_placeholder`, the text the
        model's template writes for an image); tool calls' arguments as objects (the templates of Qwen, Llama 3
        and Mistral serialize them again)."""
        # OpenAI's "developer" turn is what earlier models called the system turn; chat templates know only that one
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text(image_placeholder)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise InvalidRequestError(
                        f"tool call {c.id}: arguments must be JSON text, got {c.function.arguments[:80]!r}",
                        param="messages",
                    ) from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            out["tool_calls"] = calls
        return out

    def text(self, image_placeholder: str = "") -> str:
        """Content as plain text (text parts of a multi-part message joined, an image part as the placeholder)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if part.type == "text" else image_placeholder for part in self.content)

    def image_urls(self) -> list[tuple[int, str]]:
        """(index in content, URL) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, part.image_url.url) for j, part in enumerate(self.content) if part.type == "image_url"]


class ChatCompletionRequest(SamplingFields):
    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        check_fields("/v1/chat/completions", data)
        return data

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # extra variables for the chat template (vLLM's), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_kwargs(self):
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_RESERVED)
        if taken:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields (or the server) do",
                param="chat_template_kwargs",
            )
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequestError("tool_choice other than none needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise InvalidRequestError("tools must have distinct function names", param="tools")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto when tools are given, none otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # the thought of a reasoning model (--reasoning-parser), split from its answer; left out when there is none
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ResponseToolCall] | None = None  # only when the model called tools, as OpenAI answers


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, as on completions
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's answer to do_remote_decode, as vLLM's


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # on the finishing chunk: the stop string or token that ended it, as vLLM


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # on the first chunk with text, if asked


# -- models, tokenize ----------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fulcrum"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
