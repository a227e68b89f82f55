"""DeepSeek-V3 / R1 tool calls: after the text (content) come

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

with one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call. The markers' bars are U+FF5C (full-width vertical
line) and their spaces U+2581 (lower one eighth block), as DeepSeek's tokenizer spells them."""

from __future__ import annotations

from fulcrum.server.tool_parsers.base import CallCheck, ToolCallDelta, ToolParser, _openai_arguments
from fulcrum.server.tool_parsers.json_scan import WHITESPACE, JsonScanner

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_TYPE = "function" + SEP
_FENCE_OPEN, _FENCE_CLOSE = "```json", "```"
_MAX_NAME = 256

(
    _CONTENT,
    _LIST,  # between calls: <｜tool▁call▁begin｜> or <｜tool▁calls▁end｜>
    _TYPE_READ,  # "function<｜tool▁sep｜>"
    _NAME,  # up to the line break
    _FENCE,  # "```json"
    _BEFORE_OBJECT,
    _OBJECT,
    _AFTER_OBJECT,  # "```"
    _AFTER_FENCE,  # <｜tool▁call▁end｜>
) = range(9)


class DeepSeekV3ToolParser(ToolParser):
    """The markers are added tokens of DeepSeek's tokenizer; should a tokenizer mark them special, the integrator
    must decode with skip_special_tokens=False for this parser (as for Mistral's [TOOL_CALLS]), or the markers
    never reach it and the calls read as content. A call goes out once its JSON object is complete and checked;
    a missing closing fence, <｜tool▁call▁end｜> or <｜tool▁calls▁end｜> at the end of the output is forgiven (the
    calls stand), a wrong one turns the text from there on into content. Text after <｜tool▁calls▁end｜> is
    content; an empty list of calls is malformed. DeepSeek-V3.1's form (NAME<｜tool▁sep｜>{...}, no type and no
    fence) is not read here."""

    name = "deepseek_v3"
    arguments_key = "arguments"
    calls_prefix, calls_suffix = CALLS_BEGIN, CALLS_END

    @classmethod
    def forced_call(cls, name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}{_TYPE}{name}\n{_FENCE_OPEN}\n", f"\n{_FENCE_CLOSE}{CALL_END}"

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        super().__init__(tools, check)
        self._state = _CONTENT
        self._calls_in_list = 0
        self._name: list[str] = []
        self._function = ""
        self._scanner: JsonScanner | None = None
        self._object: list[str] = []

    def _step(self, ch: str) -> None:
        s = self._state
        if s == _CONTENT:
            if self._content_char(ch, CALLS_BEGIN):
                self._state, self._calls_in_list = _LIST, 0
        elif s == _OBJECT:
            self._scanner.feed(ch)  # an object ends at its '}': no character after it is fed here
            self._object.append(ch)
            if self._scanner.done:
                self._send()
        elif s == _NAME:
            if ch == "\n":
                name, self._name = "".join(self._name).strip(), []
                if not name:
                    raise ValueError("a tool call without a name")
                self._function = name
                self._state = _FENCE
            elif ch == "`" or ch == "<" or len(self._name) >= _MAX_NAME:
                raise ValueError("not a function name")
            else:
                self._name.append(ch)
        elif s == _TYPE_READ:
            if self._match(ch, (_TYPE,)):
                self._state = _NAME
        elif ch in WHITESPACE and not self._lit:
            pass
        elif s == _BEFORE_OBJECT and ch == "{":
            self._scanner, self._object = JsonScanner(), [ch]
            self._scanner.feed(ch)
            self._state = _OBJECT
        elif s == _LIST:
            tag = self._match(ch, (CALL_BEGIN, CALLS_END))
            if tag == CALL_BEGIN:
                self._state = _TYPE_READ
            elif tag == CALLS_END:
                if not self._calls_in_list:
                    raise ValueError("an empty list of tool calls")
                self._mark = self._pos
                self._state = _CONTENT
        elif s == _FENCE:
            if self._match(ch, (_FENCE_OPEN,)):
                self._state = _BEFORE_OBJECT
        elif s == _AFTER_OBJECT:
            if self._match(ch, (_FENCE_CLOSE,)):
                self._state = _AFTER_FENCE
        elif s == _AFTER_FENCE:
            if self._match(ch, (CALL_END,)):
                self._mark = self._pos
                self._state = _LIST
        else:
            raise ValueError(f"unexpected {ch!r} in a DeepSeek tool call")

    def _send(self) -> None:
        arguments = _openai_arguments("".join(self._object))
        if self.check is not None:
            self.check(self._function, arguments)
        self._index += 1
        self._deltas.append(ToolCallDelta(self._index, self._new_id(), self._function, arguments))
        self._calls_in_list += 1
        self._mark = self._pos
        self._state = _AFTER_OBJECT

    def _end(self) -> None:
        if self._state == _CONTENT:
            self._flush_content()
        elif self._state in (_AFTER_OBJECT, _AFTER_FENCE) or (self._state == _LIST and self._calls_in_list):
            return  # the closing markers never came (or came in part): the calls stand
        else:
            raise ValueError("the output ended inside a DeepSeek tool call")
