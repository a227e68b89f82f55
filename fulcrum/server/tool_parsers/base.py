"""What every tool-call format shares: the parsed calls and streamed deltas in OpenAI's shape, the reading of one
call object ({"name": ..., "arguments": {...}}), and the streaming machinery (`ToolParser`). A format is a
character-level state machine (`_step`, `_end`); `extract` joins what streaming sends, so that the streamed and the
whole answer are the same by construction."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from fulcrum.server.tool_parsers.json_scan import WHITESPACE, JsonScanner, JsonSyntaxError

# (name, arguments JSON text) -> None, or ValueError when the call is not to be taken as one
CallCheck = Callable[[str, str], None]


@dataclass
class ToolCall:
    """One parsed call."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it


@dataclass
class ExtractedToolCalls:
    content: str | None  # text outside the calls; None when there is none but whitespace
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One call as streamed, OpenAI's chunk.choices[0].delta.tool_calls[i]: a call goes out in one delta, once
    complete and checked."""

    index: int
    id: str
    name: str
    arguments: str  # the arguments' JSON text


@dataclass
class StreamDelta:
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# The states of _CallObject, the '{' already read.
_KEY_OR_END, _KEY_START, _KEY, _COLON, _VALUE_START, _VALUE, _COMMA_OR_END = range(7)


class _CallObject:
    """Reads one call object a character at a time, '{' already consumed: its name, and its arguments as
    OpenAI's compact JSON text (arguments written as a JSON string holding an object, as some models encode
    them twice, are decoded once). Other keys are read and ignored."""

    def __init__(self, argument_keys: tuple[str, ...]):
        self._argument_keys = argument_keys
        self._state = _KEY_OR_END
        self._scanner: JsonScanner | None = None
        self._raw: list[str] = []  # the key or value being collected
        self._key = ""
        self._seen: set[str] = set()
        self.name: str | None = None
        self.arguments: str | None = None
        self.done = False

    def feed(self, ch: str) -> None:
        s = self._state
        if s in (_KEY, _VALUE):
            if self._scanner.feed(ch):
                self._raw.append(ch)
                if self._scanner.done:
                    self._key_end() if s == _KEY else self._value_end()
                return
            self._value_end()  # a number ended; `ch` follows the value
            s = self._state
        if ch in WHITESPACE:
            return
        if (s in (_KEY_OR_END, _KEY_START)) and ch == '"':
            self._state = _KEY
            self._begin(ch)
        elif s == _COLON and ch == ":":
            self._state = _VALUE_START
        elif s == _VALUE_START:
            self._state = _VALUE
            self._begin(ch)
        elif s == _COMMA_OR_END and ch == ",":
            self._state = _KEY_START
        elif s in (_KEY_OR_END, _COMMA_OR_END) and ch == "}":
            if self.name is None or self.arguments is None:
                raise ValueError("a tool call needs a name and arguments")
            self.done = True
        else:
            raise JsonSyntaxError(f"unexpected {ch!r} in a tool call object")

    def _begin(self, ch: str) -> None:
        self._scanner = JsonScanner()
        self._raw = [ch]
        self._scanner.feed(ch)

    def _key_end(self) -> None:
        self._key = json.loads("".join(self._raw))
        # a second name or arguments (under either accepted key) leaves the call ambiguous
        role = "name" if self._key == "name" else "arguments" if self._key in self._argument_keys else None
        if role is not None:
            if role in self._seen:
                raise ValueError(f"tool call object has a second {role!r}")
            self._seen.add(role)
        self._state = _COLON

    def _value_end(self) -> None:
        self._state = _COMMA_OR_END
        if self._key == "name":
            name = json.loads("".join(self._raw))
            if not isinstance(name, str) or not name:
                raise ValueError("a tool call's name must be a non-empty string")
            self.name = name
        elif self._key in self._argument_keys:
            self.arguments = _openai_arguments("".join(self._raw))


def _openai_arguments(raw: str) -> str:
    """The arguments as OpenAI sends them: an object's compact JSON text, non-ASCII kept as it is."""
    value = json.loads(raw)
    if isinstance(value, str):  # an object encoded twice
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("a tool call's arguments must be a JSON object")
    compact = json.dumps(value, ensure_ascii=False)
    try:
        compact.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape (\ud800) cannot travel as UTF-8: keep it escaped
        return json.dumps(value)
    return compact


class ToolParser:
    """Finds the tool calls in a model's output, whole (`extract`) or streamed (`feed` each new piece of
    decoded text, then `finish`). One instance per request: streaming keeps state.

    A call goes out in one delta (id, name and its arguments as compact JSON) once its object is complete and
    `check` (the request's tools: a known name, arguments that fit its parameters) accepts it, so nothing is
    ever sent that must be taken back. A malformed call, a call `check` refuses, or one the output ends
    inside (max_tokens) turns the text from that call on into content; calls complete before it stay.
    `extract` is what streaming sends, joined: whatever the split of the text, both give one answer.
    Text that could start a marker is held back.

    For a grammar that forces calls (tool_choice "required" or a named function), the text of n >= 1
    calls is
        calls_prefix + call_separator.join(call_prefix + OBJ_i + call_suffix) + calls_suffix
    (`calls_text` builds it), where OBJ_i is {"name": <function name>, <arguments_key>: <object>}
    with any JSON whitespace. Only the Mistral format wraps the whole list (calls_prefix/calls_suffix).
    """

    name: ClassVar[str]
    call_prefix: ClassVar[str] = ""
    call_suffix: ClassVar[str] = ""
    call_separator: ClassVar[str] = ""
    calls_prefix: ClassVar[str] = ""  # before the first call's prefix (Mistral: "[TOOL_CALLS][")
    calls_suffix: ClassVar[str] = ""  # after the last call's suffix (Mistral: "]")
    arguments_key: ClassVar[str] = "arguments"  # the key the model is trained to write
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)  # the keys accepted for the arguments
    # whether a forced call can be written in this format (its arguments a JSON object the grammar enforces);
    # where not (Python keyword arguments), a forced call is written in Hermes' format and read by its parser
    forces_calls: ClassVar[bool] = True

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        """The text before and after a forced call's arguments object, as the model writes it."""
        return f'{cls.call_prefix}{{"name": {json.dumps(name)}, "{cls.arguments_key}": ', "}" + cls.call_suffix

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        self.tools = list(tools or [])
        self.check = check  # raises ValueError for a call that must not go out as one (None: any call goes)
        self._raw: list[str] = []  # every piece fed, for turning held-back text into content
        self._pos = 0  # characters consumed
        self._mark = 0  # the first consumed character not yet represented in what was sent
        self._held = ""  # text that could be the start of a marker
        self._segment_ws = ""  # a content segment's leading whitespace, sent once text follows
        self._segment_has_text = False
        self._call: _CallObject | None = None
        self._index = -1
        self._failed = False
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._lit = ""  # a marker or tag being matched, character by character (_match)

    def _match(self, ch: str, tags: tuple[str, ...]) -> str | None:
        """One character of a marker that must come here (one of `tags`): the marker once complete, None while it
        may still be one; a ValueError once it cannot."""
        lit = self._lit + ch
        if lit in tags:
            self._lit = ""
            return lit
        if not any(t.startswith(lit) for t in tags):
            raise ValueError(f"expected one of {tags}, got {lit!r}")
        self._lit = lit
        return None

    @classmethod
    def calls_text(cls, objects: list[str]) -> str:
        """The output text of the calls whose objects' JSON texts are given, as the model writes it."""
        return (
            cls.calls_prefix
            + cls.call_separator.join(cls.call_prefix + o + cls.call_suffix for o in objects)
            + (cls.calls_suffix)
        )

    def feed(self, delta_text: str) -> StreamDelta:
        self._raw.append(delta_text)
        for ch in delta_text:
            self._pos += 1
            if self._failed:
                self._content.append(ch)
                continue
            try:
                self._step(ch)
            except ValueError:  # JsonSyntaxError, json.JSONDecodeError and the call checks alike
                self._fail()
        return self._take()

    def finish(self) -> StreamDelta:
        if not self._failed:
            try:
                self._end()
            except ValueError:
                self._fail()
        return self._take()

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = type(self)(self.tools, self.check)
        deltas = [parser.feed(text), parser.finish()]
        content = "".join(d.content or "" for d in deltas)
        calls = [ToolCall(tc.id, tc.name, tc.arguments) for d in deltas for tc in d.tool_calls]
        return ExtractedToolCalls(content=content or None, tool_calls=calls)

    # --- what a format implements

    def _step(self, ch: str) -> None:
        """Consume one character; raise ValueError where the output turns out malformed."""
        raise NotImplementedError

    def _end(self) -> None:
        """The output ended; raise ValueError if that leaves it malformed."""
        raise NotImplementedError

    @staticmethod
    def _new_id() -> str:
        return "call_" + secrets.token_hex(12)

    # --- helpers for the formats

    def _content_char(self, ch: str, marker: str) -> bool:
        """One character of text outside the calls, watching for `marker`; True when it completes it."""
        held = self._held + ch
        if held == marker:
            self._held = ""
            self._end_segment()
            return True
        if marker.startswith(held):
            self._held = held
            return False
        cut = 1  # send what can no longer start the marker, hold the rest
        while not marker.startswith(held[cut:]):
            cut += 1
        self._held = held[cut:]
        self._content_text(held[:cut])
        return False

    def _content_text(self, text: str) -> None:
        """Text outside the calls. A segment of whitespace only (between calls, around them) is dropped."""
        if not self._segment_has_text:
            if text.isspace():
                self._segment_ws += text
                return
            text, self._segment_ws, self._segment_has_text = self._segment_ws + text, "", True
        self._content.append(text)
        self._mark = self._pos - len(self._held)

    def _end_segment(self) -> None:
        self._segment_ws, self._segment_has_text = "", False

    def _flush_content(self) -> None:
        """At the end: held-back text that never became a marker is content."""
        held, self._held = self._held, ""
        if held:
            self._content_text(held)
        self._end_segment()

    def _unsent(self) -> str:
        return "".join(self._raw)[self._mark : self._pos]

    def _begin_call(self) -> None:
        self._call = _CallObject(self.argument_keys)

    def _call_char(self, ch: str) -> bool:
        """One character of the current call object; True when the object is complete (and sent)."""
        call = self._call
        call.feed(ch)
        if not call.done:
            return False
        if self.check is not None:
            self.check(call.name, call.arguments)
        self._index += 1
        self._deltas.append(ToolCallDelta(self._index, self._new_id(), call.name, call.arguments))
        self._call = None
        self._mark = self._pos
        return True

    def _fail(self) -> None:
        """The output is malformed: what was held back goes out as content, and so does the rest."""
        self._failed = True
        text = self._unsent()
        if text:
            self._content.append(text)
        self._mark = self._pos

    def _take(self) -> StreamDelta:
        content = "".join(self._content) or None
        deltas, self._content, self._deltas = self._deltas, [], []
        return StreamDelta(content=content, tool_calls=deltas)
