"""argparse value types the command-line verbs share: a bad value is an exit-2 usage error naming the flag."""

from __future__ import annotations

import argparse


def non_negative_seconds(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not x >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return x
