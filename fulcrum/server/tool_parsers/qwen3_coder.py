"""Qwen3-Coder tool calls, in XML: each call is

    <tool_call>
    <function=NAME>
    <parameter=P1>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

several one after another; text around them is content. Parameter values are text, made JSON values by the
type the request's tool schema gives the parameter."""

from __future__ import annotations

import ast
import contextlib
import json

from fulcrum.server.tool_parsers.base import CallCheck, ToolCallDelta, ToolParser
from fulcrum.server.tool_parsers.hermes import HermesCalls
from fulcrum.server.tool_parsers.json_scan import WHITESPACE

_START, _END = "<tool_call>", "</tool_call>"
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_MAX_NAME = 256  # a function or parameter name longer than this is no name: the text is content

(
    _CONTENT,
    _BEFORE_FUNCTION,  # after <tool_call>: <function=NAME> (or a Hermes JSON object)
    _FUNCTION_NAME,
    _IN_FUNCTION,  # between parameters: <parameter=P> or </function>
    _PARAMETER_NAME,
    _VALUE,
    _AFTER_FUNCTION,  # </tool_call>, or a further <function=
    _OBJECT,  # a Hermes JSON call object inside <tool_call>
    _AFTER_OBJECT,
) = range(9)

_JSON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str):
    """json.loads without NaN / Infinity, which no JSON text may carry."""
    return json.loads(text, parse_constant=_no_constant)


def _declared_types(schema: object) -> set[str]:
    """The JSON types a parameter's schema names (type, or the types of its anyOf / oneOf branches)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            types |= _declared_types(branch)
    if "enum" in schema and not types:
        types = {"string"} if all(isinstance(e, str) for e in schema["enum"]) else set()
    return types


def convert_value(text: str, schema: object) -> object:
    """A parameter's text as the JSON value its schema asks for: a string parameter keeps the text; integer,
    number, boolean, object and array are read as JSON (True / False and Python-literal objects accepted as
    the model may write them); a parameter of no known type is JSON when it reads as JSON, else the text."""
    types = _declared_types(schema)
    stripped = text.strip()
    if stripped == "null" and ("null" in types or "string" not in types):
        return None
    if types and types <= {"string", "null"}:
        return text
    wanted = [t for t in types if t in _JSON_TYPES]
    candidates = []
    with contextlib.suppress(ValueError):
        candidates.append(_strict_json(stripped))
    if "boolean" in types and stripped.lower() in ("true", "false"):
        candidates.append(stripped.lower() == "true")
    if types & {"object", "array"}:
        with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            candidates.append(json.loads(json.dumps(ast.literal_eval(stripped), allow_nan=False)))
    for value in candidates:
        if "integer" in types and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not wanted or any(_JSON_TYPES[t](value) for t in wanted):
            return value
    if "string" in types or not candidates:
        return text
    return candidates[0]  # of another type than declared: the call's check will judge it


class Qwen3CoderToolParser(HermesCalls, ToolParser):
    """`<tool_call>` is an added token of Qwen's tokenizers but not a special one; `<function=`, `<parameter=`
    and their closing tags are plain text. A value runs to `</parameter>` (or to `</function>`, should the
    model leave the parameter unclosed), less one newline on each side, as the model writes them; a parameter
    named twice leaves the call ambiguous (malformed). A call goes out at `</function>`; one whose
    `</tool_call>` never comes is kept, as Hermes' is. Several `<function=` in one `<tool_call>` are read as
    several calls.

    Values take the type of the parameter in the request's `tools` (`convert_value`). For a grammar that
    forces calls the server writes Hermes' JSON call (call_prefix, {"name": ..., "arguments": {...}},
    call_suffix), which this parser reads as well."""

    name = "qwen3_coder"

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        super().__init__(tools, check)
        self._state = _CONTENT
        self._name: list[str] = []
        self._function = ""
        self._parameter = ""
        self._arguments: dict[str, object] = {}
        self._value: list[str] = []
        self._schemas: dict[str, dict] = {}
        for tool in self.tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                props = (
                    (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
                )
                self._schemas[fn["name"]] = props if isinstance(props, dict) else {}

    def _step(self, ch: str) -> None:
        s = self._state
        if s == _CONTENT:
            if self._content_char(ch, _START):
                self._state = _BEFORE_FUNCTION
        elif s == _VALUE:
            self._value_char(ch)
        elif s in (_FUNCTION_NAME, _PARAMETER_NAME):
            self._name_char(ch)
        elif s == _OBJECT:
            if self._call_char(ch):
                self._state = _AFTER_OBJECT
        elif ch in WHITESPACE and not self._lit:
            pass
        elif s == _BEFORE_FUNCTION and ch == "{" and not self._lit:
            self._begin_call()
            self._state = _OBJECT
        elif s == _BEFORE_FUNCTION:
            if self._match(ch, (_FUNCTION,)):
                self._state = _FUNCTION_NAME
        elif s == _IN_FUNCTION:
            tag = self._match(ch, (_PARAMETER, _FUNCTION_END))
            if tag == _PARAMETER:
                self._state = _PARAMETER_NAME
            elif tag == _FUNCTION_END:
                self._send_function()
        elif s == _AFTER_FUNCTION:
            tag = self._match(ch, (_END, _FUNCTION))
            if tag == _END:
                self._close_tool_call()
            elif tag == _FUNCTION:
                self._state = _FUNCTION_NAME
        elif s == _AFTER_OBJECT:
            if self._match(ch, (_END,)):
                self._close_tool_call()
        else:
            raise ValueError(f"unexpected {ch!r} in a <tool_call>")

    def _name_char(self, ch: str) -> None:
        if ch != ">":
            if ch in "<\n" or len(self._name) >= _MAX_NAME:
                raise ValueError("not a function or parameter name")
            self._name.append(ch)
            return
        name, self._name = "".join(self._name).strip(), []
        if not name:
            raise ValueError("an empty function or parameter name")
        if self._state == _FUNCTION_NAME:
            self._function, self._arguments = name, {}
        else:
            if name in self._arguments:
                raise ValueError(f"parameter {name!r} given twice")
            self._parameter, self._value = name, []
            self._state = _VALUE
            return
        self._state = _IN_FUNCTION

    def _value_char(self, ch: str) -> None:
        value = self._value
        value.append(ch)
        if ch != ">":
            return
        for tag in (_PARAMETER_END, _FUNCTION_END):
            if len(value) >= len(tag) and "".join(value[-len(tag) :]) == tag:
                text = "".join(value[: -len(tag)])
                text = text[1:] if text.startswith("\n") else text
                text = text[:-1] if text.endswith("\n") else text
                schema = self._schemas.get(self._function, {}).get(self._parameter)
                self._arguments[self._parameter] = convert_value(text, schema)
                self._value = []
                if tag == _FUNCTION_END:
                    self._send_function()
                else:
                    self._state = _IN_FUNCTION
                return

    def _send_function(self) -> None:
        try:
            arguments = json.dumps(self._arguments, ensure_ascii=False, allow_nan=False)
            arguments.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate cannot travel as UTF-8: keep it escaped
            arguments = json.dumps(self._arguments)
        if self.check is not None:
            self.check(self._function, arguments)
        self._index += 1
        self._deltas.append(ToolCallDelta(self._index, self._new_id(), self._function, arguments))
        self._mark = self._pos
        self._state = _AFTER_FUNCTION

    def _close_tool_call(self) -> None:
        self._mark = self._pos
        self._state = _CONTENT

    def _end(self) -> None:
        if self._state in (_AFTER_FUNCTION, _AFTER_OBJECT):
            return  # the closing tag never came (or came in part): the calls stand, as Hermes' do
        if self._state != _CONTENT:
            raise ValueError("the output ended inside a <tool_call>")
        self._flush_content()
