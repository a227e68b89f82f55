"""A JSON syntax check fed one character at a time: it says where a value ends and rejects the first
character that cannot continue it, so that a streamed tool call sends only text that is still a valid
start of JSON, and malformed output is caught as soon as the model writes it."""

from __future__ import annotations

WHITESPACE = " \t\n\r"  # JSON's whitespace
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"

# What the next character may be. Structural states first, then those inside a scalar.
(
    _VALUE,  # a value must start
    _VALUE_OR_CLOSE,  # just after '[': a value or ']'
    _KEY,  # after ',' in an object: a key string
    _KEY_OR_CLOSE,  # just after '{': a key string or '}'
    _COLON,
    _COMMA_OR_CLOSE,  # after a value inside a container
    _STRING,
    _ESCAPE,  # after a backslash
    _UNICODE,  # inside \uXXXX
    _LITERAL,  # inside true / false / null
    _NUM_MINUS,
    _NUM_ZERO,
    _NUM_INT,
    _NUM_DOT,
    _NUM_FRAC,
    _NUM_E,
    _NUM_E_SIGN,
    _NUM_EXP,
) = range(18)

# A number may end in these states; in the others it still lacks a digit.
_NUM_END = frozenset((_NUM_ZERO, _NUM_INT, _NUM_FRAC, _NUM_EXP))


class JsonSyntaxError(ValueError):
    """The text cannot be (the start of) one JSON value."""


def _number_step(state: int, ch: str) -> int | None:
    """The number state after `ch`, or None when `ch` is not part of the number."""
    digit = ch in _DIGITS
    if state == _NUM_MINUS:
        return _NUM_ZERO if ch == "0" else _NUM_INT if digit else None
    if state in (_NUM_ZERO, _NUM_INT):
        if digit:
            return _NUM_INT if state == _NUM_INT else None  # no leading zeros
        return _NUM_DOT if ch == "." else _NUM_E if ch in "eE" else None
    if state in (_NUM_DOT, _NUM_FRAC):
        if digit:
            return _NUM_FRAC
        return _NUM_E if state == _NUM_FRAC and ch in "eE" else None
    if state == _NUM_E:
        return _NUM_E_SIGN if ch in "+-" else _NUM_EXP if digit else None
    return _NUM_EXP if digit else None  # _NUM_E_SIGN, _NUM_EXP


class JsonScanner:
    """Reads one JSON value (RFC 8259: no NaN, no trailing commas, no comments), leading whitespace
    allowed. `feed` returns False for a character that is not part of the value: the value was already
    complete (`done`), or a number just ended there and the character belongs to what follows."""

    __slots__ = ("_stack", "_state", "_literal", "_hex_left", "_in_key", "done")

    def __init__(self) -> None:
        self._stack: list[str] = []  # the closing bracket of each open container
        self._state = _VALUE
        self._literal = ""  # the rest of true / false / null still to come
        self._hex_left = 0
        self._in_key = False
        self.done = False

    def feed(self, ch: str) -> bool:
        if self.done:
            return False
        s = self._state
        if s == _STRING:
            if ch == '"':
                if self._in_key:
                    self._in_key = False
                    self._state = _COLON
                else:
                    self._value_end()
            elif ch == "\\":
                self._state = _ESCAPE
            elif ch < " ":
                raise JsonSyntaxError(f"control character {ch!r} inside a string")
            return True
        if s == _ESCAPE:
            if ch == "u":
                self._hex_left, self._state = 4, _UNICODE
            elif ch in '"\\/bfnrt':
                self._state = _STRING
            else:
                raise JsonSyntaxError(f"bad escape \\{ch}")
            return True
        if s == _UNICODE:
            if ch not in _HEX:
                raise JsonSyntaxError(f"bad \\u escape digit {ch!r}")
            self._hex_left -= 1
            if not self._hex_left:
                self._state = _STRING
            return True
        if s == _LITERAL:
            if ch != self._literal[0]:
                raise JsonSyntaxError(f"unexpected {ch!r} in a literal")
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_end()
            return True
        if s >= _NUM_MINUS:
            nxt = _number_step(s, ch)
            if nxt is not None:
                self._state = nxt
                return True
            if s not in _NUM_END:
                raise JsonSyntaxError(f"unexpected {ch!r} in a number")
            self._value_end()
            return self.feed(ch)  # the number ended; `ch` is what follows it
        if ch in WHITESPACE:
            return True
        if s == _VALUE or (s == _VALUE_OR_CLOSE and ch != "]"):
            self._value_start(ch)
        elif s == _COMMA_OR_CLOSE and ch == ",":
            self._state = _KEY if self._stack[-1] == "}" else _VALUE
        elif s in (_VALUE_OR_CLOSE, _KEY_OR_CLOSE, _COMMA_OR_CLOSE) and ch == self._stack[-1]:
            self._stack.pop()
            self._value_end()
        elif s in (_KEY, _KEY_OR_CLOSE) and ch == '"':
            self._in_key, self._state = True, _STRING
        elif s == _COLON and ch == ":":
            self._state = _VALUE
        else:
            raise JsonSyntaxError(f"unexpected {ch!r}")
        return True

    def _value_start(self, ch: str) -> None:
        if ch == "{":
            self._stack.append("}")
            self._state = _KEY_OR_CLOSE
        elif ch == "[":
            self._stack.append("]")
            self._state = _VALUE_OR_CLOSE
        elif ch == '"':
            self._state = _STRING
        elif ch in "tfn":
            self._literal = {"t": "rue", "f": "alse", "n": "ull"}[ch]
            self._state = _LITERAL
        elif ch == "-":
            self._state = _NUM_MINUS
        elif ch in _DIGITS:
            self._state = _NUM_ZERO if ch == "0" else _NUM_INT
        else:
            raise JsonSyntaxError(f"a value cannot start with {ch!r}")

    def _value_end(self) -> None:
        if self._stack:
            self._state = _COMMA_OR_CLOSE
        else:
            self.done = True
