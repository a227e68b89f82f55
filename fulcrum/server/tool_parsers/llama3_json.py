"""Llama 3.1 / 3.2 JSON tool calls: the whole output is {"name": ..., "parameters": {...}}, several
separated by "; ", optionally after <|python_tag|>. An output that does not start like that is plain
content; one that starts like it but is not such calls is content as well (all of it)."""

from __future__ import annotations

from fulcrum.server.tool_parsers.base import CallCheck, ToolParser
from fulcrum.server.tool_parsers.json_scan import WHITESPACE

_TAG = "<|python_tag|>"
_START, _TAG_READ, _AFTER_TAG, _OBJECT, _AFTER_OBJECT, _BETWEEN, _PLAIN = range(7)


class Llama3JsonToolParser(ToolParser):
    """The model is trained to write "parameters"; "arguments" is accepted too (one of them per call).
    <|python_tag|> is a special token: with skip_special_tokens it never reaches the parser, and the
    output then starts at '{', which is read the same. Content is None whenever calls were found."""

    name = "llama3_json"
    call_separator = "; "
    arguments_key = "parameters"
    argument_keys = ("parameters", "arguments")

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        super().__init__(tools, check)
        self._state = _START
        self._tag_matched = 0

    def _step(self, ch: str) -> None:
        s = self._state
        if s == _PLAIN:
            self._content_text(ch)
        elif s == _OBJECT:
            if self._call_char(ch):
                self._state = _AFTER_OBJECT
        elif s == _TAG_READ:
            if ch == _TAG[self._tag_matched]:
                self._tag_matched += 1
                if self._tag_matched == len(_TAG):
                    self._state = _AFTER_TAG
            else:
                self._to_plain()
        elif ch in WHITESPACE:
            pass  # held: content if the output turns out plain, dropped if it is calls
        elif ch == "{" and s in (_START, _AFTER_TAG, _BETWEEN):
            self._begin_call()
            self._state = _OBJECT
        elif s == _START and ch == _TAG[0]:
            self._tag_matched = 1
            self._state = _TAG_READ
        elif s == _START:
            self._to_plain()
        elif s == _AFTER_OBJECT and ch == ";":
            self._state = _BETWEEN
        else:
            raise ValueError(f"unexpected {ch!r} between Llama JSON tool calls")

    def _to_plain(self) -> None:
        """Not a tool call: everything read so far, and all that follows, is content."""
        self._state = _PLAIN
        self._content_text(self._unsent())

    def _end(self) -> None:
        if self._state == _TAG_READ:
            self._to_plain()
        elif self._state in (_AFTER_TAG, _OBJECT):
            raise ValueError("the output ended before its tool call was complete")
        # a trailing "; " after the last call is forgiven, as vLLM skips the empty piece
        self._end_segment()
