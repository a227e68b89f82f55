"""Mistral tool calls (7B Instruct v0.3 and the models that write the same): [TOOL_CALLS] then a JSON
array of {"name": ..., "arguments": {...}}; text before the marker is content."""

from __future__ import annotations

import secrets
import string

from fulcrum.server.tool_parsers.base import CallCheck, ToolParser
from fulcrum.server.tool_parsers.json_scan import WHITESPACE

_MARKER = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_CONTENT, _AFTER_MARKER, _FIRST, _OBJECT, _AFTER_OBJECT, _NEXT = range(6)


class MistralToolParser(ToolParser):
    """The whole array is one unit, so the calls are not wrapped one by one: a grammar forcing calls
    writes calls_prefix "[TOOL_CALLS][", the call objects joined by call_separator ", ", and
    calls_suffix "]" (call_prefix and call_suffix are empty).

    [TOOL_CALLS] is a special token: the integrator must decode with skip_special_tokens=False for this
    parser (vLLM does the same), or the marker never reaches it and the calls read as content. Text after
    the closing ']' is content, and a further [TOOL_CALLS][...] adds calls; an array the output never
    closes is kept as far as its complete objects. Newer Mistral tokenizers' `[TOOL_CALLS]name{...}` form
    is not read here."""

    name = "mistral"
    calls_prefix = "[TOOL_CALLS]["
    calls_suffix = "]"
    call_separator = ", "
    arguments_key = "arguments"

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        super().__init__(tools, check)
        self._state = _CONTENT

    @staticmethod
    def _new_id() -> str:
        # Mistral's own validation wants 9 alphanumeric characters (mistral-common; vLLM follows it).
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def _step(self, ch: str) -> None:
        s = self._state
        if s == _CONTENT:
            if self._content_char(ch, _MARKER):
                self._state = _AFTER_MARKER
        elif s == _OBJECT:
            if self._call_char(ch):
                self._state = _AFTER_OBJECT
        elif ch in WHITESPACE:
            pass
        elif s == _AFTER_MARKER and ch == "[":
            self._state = _FIRST
        elif s in (_FIRST, _NEXT) and ch == "{":
            self._begin_call()
            self._state = _OBJECT
        elif s == _AFTER_OBJECT and ch == ",":
            self._state = _NEXT
        elif s == _AFTER_OBJECT and ch == "]":
            # An empty array is malformed (the else below): dropping its text would leave nothing to
            # turn back into content if a later call were malformed.
            self._mark = self._pos
            self._state = _CONTENT
        else:
            raise ValueError(f"unexpected {ch!r} in a [TOOL_CALLS] array")

    def _end(self) -> None:
        if self._state in (_AFTER_MARKER, _FIRST, _OBJECT, _NEXT):
            raise ValueError("the output ended inside a [TOOL_CALLS] array")
        self._flush_content()
