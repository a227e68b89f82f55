"""Pythonic tool calls (Llama 3.2, Llama 4 and the models that write the same): the output is a Python list
of calls with keyword arguments, [get_weather(city="Paris", unit="c"), get_time()], whose values are Python
literals; Llama 4 wraps it in <|python_start|> ... <|python_end|>. Text after the list is content, and so is
an output that does not start with the list (a later <|python_start|>[...] still adds calls)."""

from __future__ import annotations

import ast
import json
import math

from fulcrum.server.tool_parsers.base import CallCheck, ToolCallDelta, ToolParser
from fulcrum.server.tool_parsers.json_scan import WHITESPACE

_OPEN, _CLOSE = "<|python_start|>", "<|python_end|>"
_BRACKETS = {"(": ")", "[": "]", "{": "}"}
_QUOTES = "'\""
_MAX_DEPTH = 64  # nesting beyond this is no call a model writes (and would strain the Python parser)

(
    _START,  # nothing but whitespace yet: '[' starts calls, anything else is content
    _CONTENT,  # watching for <|python_start|>
    _AFTER_OPEN,  # after <|python_start|>: '['
    _NAME_START,  # a call's name must start
    _NAME,
    _ARGUMENTS,  # inside the call's parentheses
    _AFTER_CALL,  # ',' or ']'
    _TAIL,  # after ']': content, watching for <|python_end|>
) = range(8)


def _json_value(value: object) -> object:
    """A Python literal as the JSON value it stands for; ValueError for what JSON has no value for."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("a number JSON cannot write")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("an object's keys must be strings")
        return {k: _json_value(v) for k, v in value.items()}
    raise ValueError(f"a {type(value).__name__} is no JSON value")


def read_call(text: str) -> tuple[str, dict]:
    """`name(key=literal, ...)`: the name and the arguments as JSON values, read without evaluating any code
    (ast.parse, then ast.literal_eval of each value); ValueError for anything else."""
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call of a plain function name")
        if node.args or any(kw.arg is None for kw in node.keywords):
            raise ValueError("a tool call's arguments must be keyword arguments")
        if len({kw.arg for kw in node.keywords}) != len(node.keywords):  # only the compiler refuses it, not ast
            raise ValueError("a keyword argument given twice")
        arguments = {kw.arg: _json_value(ast.literal_eval(kw.value)) for kw in node.keywords}
    except (SyntaxError, TypeError, MemoryError, RecursionError) as e:  # ValueError passes as it is
        raise ValueError(f"not a Python call: {e}") from None
    return node.func.id, arguments


class PythonicToolParser(ToolParser):
    """<|python_start|> and <|python_end|> are special tokens of Llama 4's tokenizer: with skip_special_tokens
    they never reach the parser and the output starts at '[', which is read the same. A call goes out once its
    closing parenthesis is read and it parses; a call cut off, malformed, or refused by the check turns the text
    from it on into content, as in the other formats. Arguments are keyword arguments only (a positional one is
    malformed), their values Python literals: True / False / None become true / false / null, tuples arrays; a
    set, bytes, a complex number or a non-string key is malformed."""

    name = "pythonic"
    call_separator = ", "
    calls_prefix = "["
    calls_suffix = "]"
    forces_calls = False  # keyword arguments are no JSON object: a forced call is written in Hermes' format

    def __init__(self, tools: list[dict] | None = None, check: CallCheck | None = None):
        super().__init__(tools, check)
        self._state = _START
        self._text: list[str] = []  # the call being read, from its name on
        self._stack: list[str] = []  # the closing bracket of each open one, the call's own ')' first
        self._quote = ""  # the quote character of the string being read ("" outside strings)
        self._triple = False
        self._escape = False
        self._run = 0  # quote characters in a row: an empty string, or the end of a triple-quoted one
        self._empty = ""  # the quote of an empty string just closed (a third quote opens a triple-quoted string)
        self._opened = 0  # where the string being read starts in _text

    def _step(self, ch: str) -> None:
        s = self._state
        if s == _ARGUMENTS:
            self._argument_char(ch)
        elif s == _NAME:
            if ch == "(":
                self._text.append(ch)
                self._stack = [")"]
                self._state = _ARGUMENTS
            elif ("a" + ch).isidentifier():
                self._text.append(ch)
            else:
                raise ValueError(f"unexpected {ch!r} in a call's name")
        elif s == _CONTENT:
            if self._content_char(ch, _OPEN):
                self._state = _AFTER_OPEN
        elif s == _TAIL:
            if self._content_char(ch, _CLOSE):
                self._state = _CONTENT
        elif ch in WHITESPACE:
            if s == _START:
                self._content_text(ch)  # kept aside: dropped if calls follow, leads the content if not
        elif s in (_START, _AFTER_OPEN) and ch == "[":
            self._end_segment()
            self._state = _NAME_START
        elif s == _START:
            self._state = _CONTENT
            self._step(ch)
        elif s == _NAME_START and ch.isidentifier():
            self._text = [ch]
            self._state = _NAME
        elif s == _AFTER_CALL and ch == ",":
            self._state = _NAME_START
        elif s == _AFTER_CALL and ch == "]":
            self._mark = self._pos
            self._state = _TAIL
        else:
            raise ValueError(f"unexpected {ch!r} in a list of Python calls")

    def _argument_char(self, ch: str) -> None:
        self._text.append(ch)
        q = self._quote
        if q:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == q:
                self._run += 1
                if not self._triple:  # an empty string may be the start of a triple-quoted one
                    self._quote, self._empty = "", (q if len(self._text) - 1 == self._opened else "")
                elif self._run == 3:
                    self._quote = ""
                return
            elif ch == "\n" and not self._triple:
                raise ValueError("a line break inside a one-line string")
            self._run = 0
            return
        if ch in _QUOTES:
            self._quote, self._triple, self._run = ch, self._empty == ch, 0  # '' then ': a triple-quoted string
            self._empty, self._opened = "", len(self._text)
            return
        self._empty = ""
        if ch in _BRACKETS:
            if len(self._stack) >= _MAX_DEPTH:
                raise ValueError("nested too deeply")
            self._stack.append(_BRACKETS[ch])
        elif ch in ")]}":
            if ch != self._stack.pop():
                raise ValueError(f"unbalanced {ch!r}")
            if not self._stack:
                self._send("".join(self._text))
        elif ch == "#":
            raise ValueError("a comment inside a call")

    def _send(self, text: str) -> None:
        name, arguments = read_call(text)
        try:
            compact = json.dumps(arguments, ensure_ascii=False)
            compact.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate cannot travel as UTF-8: keep it escaped
            compact = json.dumps(arguments)
        if self.check is not None:
            self.check(name, compact)
        self._index += 1
        self._deltas.append(ToolCallDelta(self._index, self._new_id(), name, compact))
        self._mark = self._pos
        self._text = []
        self._state = _AFTER_CALL

    def _end(self) -> None:
        if self._state in (_AFTER_OPEN, _NAME_START, _NAME, _ARGUMENTS):
            raise ValueError("the output ended inside a list of Python calls")
        # a list never closed is kept as far as its complete calls, as Mistral's array is
        self._flush_content()
