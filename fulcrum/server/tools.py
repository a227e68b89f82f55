"""Tool calling on /v1/chat/completions: which parser reads the model's calls, the grammar that makes
`tool_choice: required` or a named function always produce valid calls in the parser's own format, and the
parsed calls in OpenAI's shapes (whole and streamed)."""

from __future__ import annotations

import json

import jsonschema_rs

from fulcrum.engine.structured.grammar import first_line, unenforced_keywords, validate
from fulcrum.errors import InvalidRequestError
from fulcrum.protocol import (
    ChatCompletionRequest,
    DeltaFunction,
    DeltaToolCall,
    NamedToolChoice,
    ResponseToolCall,
    ToolCallFunction,
)
from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.server.tool_parsers import ExtractedToolCalls, StreamDelta, ToolParser, get_tool_parser

# the format a forced call is written in when the server was started without --tool-call-parser
DEFAULT_FORCED_FORMAT = "hermes"
NO_PARAMETERS = {"type": "object", "properties": {}}
# A forced turn's calls are bounded: a model that prefers the separator to its end token (the bundled one does)
# would otherwise write calls until max_tokens cuts one in half and none can be read.
MAX_PARALLEL_CALLS = 8
# Models write their calls' JSON compactly (Hermes, Llama 3 and Mistral alike): a little whitespace per gap, not
# the free whitespace (grammar.FREE_WHITESPACE) a client may ask for
CALL_WHITESPACE = 4


class ToolCalling:
    """What one chat request does with tools (None from `of` when it has none, or tool_choice none)."""

    def __init__(self, req: ChatCompletionRequest, parser_name: str | None):
        self.choice = req.effective_tool_choice
        self.tools = [t.model_dump(exclude_none=True) for t in req.tools]
        self.parallel = req.parallel_tool_calls
        self.forced = self.choice == "required" or isinstance(self.choice, NamedToolChoice)
        if not self.forced and parser_name is None:
            raise InvalidRequestError(
                'tool_choice "auto" needs a tool-call parser: start the server with --tool-call-parser '
                "(one of fulcrum serve --help's), or ask for tool_choice required or a named function",
                param="tool_choice",
            )
        self.parser_name = parser_name or DEFAULT_FORCED_FORMAT
        self.parser_class = type(get_tool_parser(self.parser_name))
        if self.forced and not self.parser_class.forces_calls:
            self.parser_name = DEFAULT_FORCED_FORMAT
            self.parser_class = type(get_tool_parser(self.parser_name))
        self._validators = {t["function"]["name"]: _arguments_validator(t["function"]) for t in self.tools}

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser_name: str | None) -> ToolCalling | None:
        if not req.tools or req.effective_tool_choice == "none":
            return None
        return cls(req, parser_name)

    def parser(self) -> ToolParser:
        """A fresh parser (streaming keeps state: one per sample)."""
        return get_tool_parser(self.parser_name, self.tools, self.check_call)

    def check_call(self, name: str, arguments: str) -> None:
        """A call the model wrote is taken as one only when it names a tool of the request's and its arguments
        fit that tool's parameters; otherwise (ValueError) the parser gives its text back as content, as for
        text that is no call at all. A forced call's grammar already keeps to both."""
        if name not in self._validators:
            raise ValueError(f"{name!r} is not one of the request's tools")
        validator = self._validators[name]
        if validator is not None and not validator.is_valid(json.loads(arguments)):
            raise ValueError(f"the arguments of {name!r} do not fit its parameters")

    @property
    def skip_special_tokens(self) -> bool:
        return self.parser_name != "mistral"  # [TOOL_CALLS] is a special token of Mistral's tokenizers

    def grammar(self) -> StructuredOutputsParams | None:
        """For required and named choices: calls in the parser's format, each {"name": <a tool>, <arguments key>:
        <an object of that tool's parameters schema>}; one call for a named function or without parallel calls."""
        if not self.forced:
            return None
        named = self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None
        p = self.parser_class
        tags = []
        for tool in self.tools:
            fn = tool["function"]
            if named is not None and fn["name"] != named:
                continue
            schema = fn.get("parameters") or NO_PARAMETERS
            unenforced = unenforced_keywords(schema)
            if unenforced:
                raise InvalidRequestError(
                    f"the parameters of {fn['name']} use what a forced tool call cannot enforce: "
                    + ", ".join(unenforced[:5]),
                    param="tools",
                )
            try:  # each tool's schema on its own, so that a fault is named by its tool, not by the whole tag
                validate(StructuredOutputsParams(json=schema))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"the parameters of {fn['name']}: {e}", param="tools") from None
            begin, end = p.forced_call(fn["name"])
            tags.append(
                {
                    "type": "tag",
                    "begin": begin,
                    "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": CALL_WHITESPACE},
                    "end": end,
                }
            )
        call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        parts = [{"type": "const_string", "value": v} for v in (p.calls_prefix,) if v]
        parts.append(call)
        if named is None and self.parallel:
            more = {"type": "sequence", "elements": [{"type": "const_string", "value": p.call_separator}, call]}
            parts.append({"type": "repeat", "min": 0, "max": MAX_PARALLEL_CALLS - 1, "content": more})
        parts += [{"type": "const_string", "value": v} for v in (p.calls_suffix,) if v]
        fmt = parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))

    def finish_reason(self, extracted_calls: int, finish_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools of its own choice (auto, required); a named function's
        call ends with "stop"."""
        if extracted_calls and finish_reason == "stop" and not isinstance(self.choice, NamedToolChoice):
            return "tool_calls"
        return finish_reason


def _no_fetch(uri: str):
    raise ValueError(f"{uri}: a tool's parameters may refer only within themselves")


def _arguments_validator(function: dict) -> jsonschema_rs.Validator | None:
    """A checker of a function's arguments against its parameters schema (None: it declares none, so any
    object). jsonschema-rs: every keyword enforced, regexes in linear time (a pattern that backtracks cannot
    stall the server on the model's output), and nothing fetched over the network for a $ref."""
    schema = function.get("parameters")
    if schema is None:
        return None
    try:
        return jsonschema_rs.validator_for(
            schema, retriever=_no_fetch, pattern_options=jsonschema_rs.RegexOptions(), validate_formats=True
        )
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as e:
        raise InvalidRequestError(
            f"the parameters of {function['name']} are not a usable JSON schema: {first_line(e)}", param="tools"
        ) from None


def response_calls(extracted: ExtractedToolCalls) -> list[ResponseToolCall]:
    return [
        ResponseToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
        for c in extracted.tool_calls
    ]


def delta_calls(delta: StreamDelta) -> list[DeltaToolCall] | None:
    if not delta.tool_calls:
        return None
    return [
        DeltaToolCall(
            index=d.index, id=d.id, type="function", function=DeltaFunction(name=d.name, arguments=d.arguments)
        )
        for d in delta.tool_calls
    ]
