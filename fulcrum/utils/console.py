"""A rich console that stays wide when its stream is a file or a pipe (rich assumes 80 columns there,
which folds tables)."""

from __future__ import annotations

import sys

from rich.console import Console


def wide_console(stderr: bool = False, width: int = 150) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else width)
