"""The engine process's CPU setup, in the order the model runner needs it: the weights settled once loaded, the
compute threads placed once the kernels are built (a build would inherit the pinning)."""

from __future__ import annotations

import logging

from torch import nn

from fulcrum.errors import InvalidRequestError
from fulcrum.runtime import cpu_malloc, cpu_threads
from fulcrum.runtime.hugepages import move_parameters_to_huge_pages

log = logging.getLogger(__name__)


def settle_weights(model: nn.Module) -> None:
    """A CPU model's weights on huge pages (a decode step streams them all: fewer TLB misses), and malloc told to
    keep freed memory (each step's activations reuse the last one's pages)."""
    move_parameters_to_huge_pages(model)
    cpu_malloc.keep_freed_memory()


def place_threads(threads: int | None, bind: str | None, own_process: bool, rank: int = 0, world_size: int = 1,
                  nice: int | None = None):  # fmt: skip
    """Size and pin the compute threads (runtime/cpu_threads.py) for this rank, and put every thread of the process
    at niceness `nice` where it is more than 0 (cpu_threads.engine_nice decides it); a bad --cpu-bind is a 400-style
    error naming it. Returns what was applied, for the log."""
    try:
        if world_size > 1:
            plan = cpu_threads.rank_plan(threads, bind, own_process, rank, world_size)
        else:
            plan = cpu_threads.plan(threads, bind, own_process)
        applied = cpu_threads.apply(plan)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="cpu_bind") from e
    niceness = cpu_threads.lower_priority(nice) if nice else None
    log.info("CPU: %s%s", applied.describe(), f", nice {niceness}" if niceness else "")
    return applied
