"""Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls: each call is
<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, several one after another; text around
them is content."""

from __future__ import annotations

from fulcrum.server.tool_parsers.base import CallCheck, ToolParser
from fulcrum.server.tool_parsers.json_scan import WHITESPACE

_START, _END = "<tool_call>", "</tool_call>"
_CONTENT, _BEFORE_OBJECT, _OBJECT, _AFTER_OBJECT, _END_TAG = range(5)


class HermesCalls:
    """Hermes' call format, <tool_call>{"name": ..., "arguments": {...}}</tool_call> per call: how forced calls are
    written for the parsers that read it (hermes, and qwen3_coder beside its XML form)."""

    call_prefix = "<tool_call>\n"
    call_suffix = "\n</tool_call>"
    call_separator = "\n"
    arguments_key = "arguments"


class HermesToolParser(HermesCalls, ToolParser):
    """`<tool_call>` is an added token of these tokenizers but not a special one, so it survives
    skip_special_tokens. A call whose `</tool_call>` never comes (the output ends after its object) is
    kept, as vLLM keeps it."""

    name = "hermes"

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        super().__init__(tools, check)
        self._state = _CONTENT
        self._end_matched = 0  # characters of </tool_call> read

    def _step(self, ch: str) -> None:
        s = self._state
        if s == _CONTENT:
            if self._content_char(ch, _START):
                self._state = _BEFORE_OBJECT
        elif s == _OBJECT:
            if self._call_char(ch):
                self._state = _AFTER_OBJECT
        elif ch in WHITESPACE and s in (_BEFORE_OBJECT, _AFTER_OBJECT):
            pass
        elif s == _BEFORE_OBJECT and ch == "{":
            self._begin_call()
            self._state = _OBJECT
        elif s in (_AFTER_OBJECT, _END_TAG) and ch == _END[self._end_matched]:
            self._end_matched += 1
            self._state = _END_TAG
            if self._end_matched == len(_END):
                self._end_matched = 0
                self._mark = self._pos
                self._state = _CONTENT
        else:
            raise ValueError(f"unexpected {ch!r} around a <tool_call>")

    def _end(self) -> None:
        if self._state in (_BEFORE_OBJECT, _OBJECT):
            raise ValueError("the output ended inside a <tool_call>")
        self._flush_content()
