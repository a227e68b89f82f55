"""argparse value types the command-line verbs share: a bad value is an exit-2 usage error naming the flag."""

from __future__ import annotations

import argparse
import sys


def _parsed(value: str, kind: type, what: str):
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None


def non_negative_seconds(value: str) -> float:
    x = _parsed(value, float, "a number of seconds")
    if not x >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return x


def positive_int(value: str) -> int:
    n = _parsed(value, int, "a whole number")
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def non_negative_float(value: str) -> float:
    x = _parsed(value, float, "a number")
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


def positive_float(value: str) -> float:
    x = _parsed(value, float, "a number")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return x


def non_negative_int(value: str) -> int:
    n = _parsed(value, int, "a whole number")
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return n


def seconds_with_unit(text: str) -> float:
    """`500ms`, `2s` or `2` (seconds) -> seconds: the SLO values of `fulcrum bench` and `fulcrum tune`."""
    t, scale = text.strip().lower(), 1.0
    if t.endswith("ms"):
        t, scale = t[:-2], 1e-3
    elif t.endswith("s"):
        t = t[:-1]
    return float(t) * scale  # ValueError for the caller to word


def checked(parse):
    """An argparse type from a parser that raises ValueError: its message becomes the usage error."""

    def run(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return run


def one_line_errors(verb: str):
    """A parser's `error` that prints one line (not argparse's usage block) and exits 2."""

    def error(message: str):
        print(f"fulcrum {verb}: {message} (fulcrum {verb} --help for the flags)", file=sys.stderr)
        raise SystemExit(2)

    return error
