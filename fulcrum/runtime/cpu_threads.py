"""The engine core's CPU threads: how many compute (`--cpu-threads`), and on which cores (`--cpu-bind`: none, auto, or
a core list), as vLLM's CPU backend does with VLLM_CPU_OMP_THREADS_BIND. Unpinned threads with a client on the same
cores collapsed throughput (benchmarks/results/cpu-threads-colocated-avx2.log); pinning is a small native call on
every thread of torch's OpenMP pool (kernels/csrc/cpu_threads.cpp), else the whole process is confined to the cores.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR

log = logging.getLogger(__name__)

BINDINGS = {"cpu_threads.cpp": {"fulcrum_bind_threads": (I64, PTR, I64), "fulcrum_thread_cpus": (None, PTR, I64)}}


def allowed_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask)."""
    return sorted(os.sched_getaffinity(0))


def parse_cpus(spec: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6]; ValueError for anything else."""
    cpus: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu list {spec!r}: expected cores such as 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu list {spec!r}: range {part} runs backwards")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu list {spec!r} names a core twice")
    return cpus


def check_bind(bind: str) -> None:
    """Raise ValueError unless `bind` is auto, none or a core list."""
    if bind not in ("auto", "none"):
        parse_cpus(bind)


# `fulcrum serve` leaves its HTTP frontend a core of its own only on machines with at least this many: on fewer,
# the core is a large share of the compute, and the frontend (a small share of a core per request since its
# plain-ASGI gate and coalesced reads) does better sharing. Bundled model, 2-core AMD EPYC, 128 in / 64 out: every
# core computing (the frontend beside thread 0) against one left to the frontend, TTFT p50 21 vs 28 ms at
# concurrency 1, 63 vs 84 ms at 4; output 1598 vs 1496 tok/s at 16, 1854 vs 1434 at 64.
FRONTEND_CORE_MIN_CPUS = 8


# The niceness an engine core computing in a process of its own beside `fulcrum serve`'s frontend takes (--cpu-nice):
# the frontend's work (reading a request, tokenizing, streaming each token out) is short bursts that a compute thread
# at the same priority holds up for a scheduler slice, on the cores the engine fills. At 10 the kernel runs the
# frontend as soon as it wakes, and the engine gets every cycle the frontend leaves. Bundled model, 2-core AMD EPYC
# (Zen 5), 128 in / 64 out, `fulcrum bench serve` on the same cores, nice 0 against 10 in turn:
# benchmarks/results/cpu_batched/engine-nice-zen5-s72.log.
ENGINE_NICE = 10


def engine_nice(nice: int | None, own_process: bool) -> int:
    """The niceness an engine computes at: `nice` where given (--cpu-nice), else ENGINE_NICE for an engine core in a
    process of its own beside a frontend, and 0 (left as it is) in a user's process."""
    if nice is not None:
        return nice
    return ENGINE_NICE if own_process else 0


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    cpus: tuple[int, ...] | None  # the core of each thread, or None: unpinned

    def describe(self) -> str:
        where = "unpinned" if self.cpus is None else "pinned to cores " + ",".join(map(str, self.cpus))
        return f"{self.threads} compute thread{'s' * (self.threads != 1)}, {where}"


def plan(threads: int | None, bind: str, own_process: bool = False) -> ThreadPlan:
    """What `apply` will do for `--cpu-threads threads --cpu-bind bind` on this machine.

    `own_process`: the engine core has a process of its own beside a frontend (`fulcrum serve`, which tokenizes,
    detokenizes and streams while the core computes). There `auto` pins, and on a machine of FRONTEND_CORE_MIN_CPUS
    cores or more leaves the frontend one of them. In a user's own process (`LLM(...)`) `auto` pins nothing:
    pinning reaches the calling thread, and every thread and process it starts later would inherit one core. A core
    list pins wherever it is given. ValueError when the cores asked for are not ones this process may use, or fewer
    than the threads."""
    check_bind(bind)
    allowed = allowed_cpus()
    free = allowed[1:] if own_process and len(allowed) >= FRONTEND_CORE_MIN_CPUS else allowed
    if bind == "none" or (bind == "auto" and not own_process):
        return ThreadPlan(threads or len(free), None)
    if bind == "auto":
        cpus = free if threads is None or threads <= len(free) else allowed
    else:
        cpus = parse_cpus(bind)
        if not set(cpus) <= set(allowed):
            missing = sorted(set(cpus) - set(allowed))
            raise ValueError(
                f"--cpu-bind {bind}: cores {missing} are not available to this process (allowed: {allowed})"
            )
    n = threads or len(cpus)
    if n > len(cpus):
        raise ValueError(f"--cpu-threads {n} is more than the {len(cpus)} cores it can be bound to ({bind})")
    return ThreadPlan(n, tuple(cpus[:n]))


def rank_plan(threads: int | None, bind: str, own_process: bool, rank: int, world: int) -> ThreadPlan:
    """Rank `rank` of a parallel engine of `world` ranks, each a process computing at the same time: its share of
    the cores (the bound list, or those allowed, less the frontend's where the engine serves and cores are left over),
    dealt out round robin, one thread per core of the share unless `threads` says. Pinned, except with `none` and
    for rank 0 inside a user's process (LLM(...)), whose pinning would reach the caller's thread."""
    check_bind(bind)
    cores = parse_cpus(bind) if bind not in ("auto", "none") else allowed_cpus()
    if own_process and bind == "auto" and len(cores) > world and len(cores) >= FRONTEND_CORE_MIN_CPUS:
        cores = cores[1:]
    share = cores[rank::world] or [cores[rank % len(cores)]]
    n = threads or len(share)
    if bind == "none" or (bind == "auto" and rank == 0 and not own_process):
        return ThreadPlan(n, None)
    if n > len(share):
        raise ValueError(f"--cpu-threads {n} per rank is more than the {len(share)} cores of rank {rank}'s share")
    return ThreadPlan(n, tuple(share[:n]))


@functools.cache
def _lib():
    return cpu_ext.load("cpu_threads.cpp", "none", BINDINGS["cpu_threads.cpp"])  # needs no vector ISA


def apply(p: ThreadPlan) -> ThreadPlan:
    """Size torch's pool and pin its threads as planned (call before the first op runs, in the process that
    computes). Returns the plan."""
    torch.set_num_threads(p.threads)
    if p.cpus is None:
        return p
    lib = _lib()
    cpus = torch.tensor(p.cpus, dtype=torch.int64)
    if lib is None or lib.fulcrum_bind_threads(cpus.data_ptr(), p.threads) != 0:
        log.warning("could not pin each compute thread; confining the process to cores %s instead", p.cpus)
        os.sched_setaffinity(0, p.cpus)
    return p


def lower_priority(nice: int) -> int:
    """Every thread of this process (and so each it starts later) at niceness `nice` or lower priority: a thread
    already nicer (the process was started under `nice`) keeps its own. Returns the niceness of the calling thread;
    a thread that cannot be reniced (it exited meanwhile) is skipped."""
    for tid in _thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (ProcessLookupError, PermissionError):
            continue
    return os.getpriority(os.PRIO_PROCESS, 0)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [threading.get_native_id()]


def thread_cpus() -> list[int] | None:
    """The core each thread of torch's pool is on now (a pinned thread never moves), or None without the
    native helper."""
    lib = _lib()
    if lib is None:
        return None
    out = torch.zeros(torch.get_num_threads(), dtype=torch.int64)
    lib.fulcrum_thread_cpus(out.data_ptr(), out.numel())
    return out.tolist()
