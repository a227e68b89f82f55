"""Grammar compiles in a process of their own, so that one can be stopped and its memory bounded.

xgrammar compiles in C++ with no way to interrupt it, and a compile's cost is not a spec's size (a small JSON schema of
many optional properties compiles through gigabytes, quadratic in them): in the engine core such a compile would run
until it finished or the kernel killed the core. Each compile gets a worker forked for it alone (`CompileLane`)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import resource
import signal
import threading
from collections.abc import Callable

import xgrammar as xgr

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting compile looks whether its request still wants it
# A compile is work that one request asks for, and a client may send a spec that compiles for seconds before it
# fails (2,000 optional properties: 1.5 s of CPU to reach 256 MiB). The worker runs this much nicer than the core, so
# that where the cores are all busy serving the other requests comes first; on idle cores it runs at full speed.
# Four clients sending such schemas in a loop took a quarter of a 2-core machine's CPU away from 46 others at the same
# priority (tests/server/test_soak.py's hostile soak).
COMPILE_NICENESS = 10
_PR_SET_PDEATHSIG = 1


class CompileAbandoned(Exception):
    """The request stopped waiting (it ended, or its compile timed out): the worker was stopped."""


class CompileFailed(Exception):
    """The spec cannot be compiled (xgrammar's reason, or a limit it ran into)."""


class CompileRefused(CompileFailed):
    """The worker's own answer that the spec cannot compile (xgrammar's error, the memory or size limit): the same
    spec fails the same way again, so the core need not compile it twice."""


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not glibc: a core that is killed leaves it until its pipe closes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _limit_memory(extra_bytes: int) -> None:
    """Cap the worker's address space at what it inherited plus `extra_bytes` (a fork shares the core's mappings,
    so the cap has to start from its present size)."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _serve(conn, spec, info: xgr.TokenizerInfo, compile_fn, memory_bytes: int, max_compiled_bytes: int) -> None:
    """The worker: compile `spec`, answer (True, serialized grammar) or (False, reason)."""
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.nice(COMPILE_NICENESS)  # raising one's own niceness is always allowed (it stops at 19)
    _limit_memory(memory_bytes)
    try:
        compiled = compile_fn(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), spec)
        size = compiled.memory_size_bytes
        if size > max_compiled_bytes:
            answer = (False, f"it compiles to {size / 2**20:.0f} MiB, above the {max_compiled_bytes / 2**20:.0f} MiB "
                             "a grammar may take; simplify the schema or grammar")  # fmt: skip
        else:
            answer = (True, compiled.serialize_json())
    except MemoryError:
        answer = (False, _memory_message(memory_bytes))
    except Exception as e:  # xgrammar's own errors carry a readable message
        answer = (False, _memory_message(memory_bytes) if "bad_alloc" in str(e) else str(e))
    conn.send(answer)


def _memory_message(memory_bytes: int) -> str:
    return (
        f"compiling it needs more than the {memory_bytes / 2**20:.0f} MiB a grammar compile may use "
        "(fulcrum serve --grammar-compile-memory); simplify the schema or grammar"
    )


class _Worker:
    """A worker forked for one compile (os.fork: the engine core is itself a daemonic multiprocessing process,
    which multiprocessing does not let have children) and the core's end of its pipe. Forked, it starts with xgrammar
    and the vocabulary already loaded (a fresh interpreter takes seconds), at a cost that grows with the memory the
    core holds; it ends with its compile, so the pages the core writes meanwhile (the KV cache) are copied only for
    that long, never kept twice. It dies with the core (PR_SET_PDEATHSIG)."""

    def __init__(self, spec, args: tuple):
        parent, child = mp.Pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the core's code
            code = 0
            try:
                parent.close()
                _serve(child, spec, *args)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        child.close()
        self.pid, self.conn = pid, parent
        self.exitcode: int | None = None

    def alive(self) -> bool:
        if self.exitcode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def end(self) -> None:
        """Kill it if it still runs, reap it, close the pipe."""
        if self.alive():
            self.kill()
            self.exitcode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.conn.close()


class CompileLane:
    """Compiles one at a time (its caller's executor has one thread), each in a worker of its own. `compile` waits
    for the worker's answer and, if `abandoned` is set meanwhile (the client left, the compile timeout passed), kills
    the worker; a compile that needs more memory than the worker may take (RLIMIT_AS) fails with an error naming the
    limit. The compiled grammar comes back serialized and is rebuilt against the core's own tokenizer info; compiled
    grammars are cached by spec in the core (grammar.py)."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        compile_fn: Callable[[xgr.GrammarCompiler, object], xgr.CompiledGrammar],
        memory_bytes: int,
        max_compiled_bytes: int,
    ):
        self._args = (info, compile_fn, memory_bytes, max_compiled_bytes)
        self._worker: _Worker | None = None
        self._lock = threading.Lock()
        self.started = 0  # workers forked, one per compile
        self.stopped = 0  # compiles stopped before they finished

    def compile(self, spec, abandoned: threading.Event) -> str:
        """The serialized compiled grammar (CompiledGrammar.serialize_json)."""
        with self._lock:
            if abandoned.is_set():
                raise CompileAbandoned()
            w = self._worker = _Worker(spec, self._args)
            self.started += 1
            try:
                while not w.conn.poll(_POLL_S):
                    if abandoned.is_set():
                        self.stopped += 1
                        raise CompileAbandoned()
                    if not w.alive():
                        raise CompileFailed(f"the grammar compiler stopped (exit code {w.exitcode})")
                ok, payload = w.conn.recv()
            except (EOFError, OSError):
                raise CompileFailed(f"the grammar compiler stopped (exit code {w.exitcode})") from None
            finally:
                w.end()
                self._worker = None
        if not ok:
            raise CompileRefused(payload)
        return payload

    def close(self) -> None:
        """End a compile in progress now (it fails)."""
        w = self._worker
        if w is not None:
            w.kill()

    @property
    def pid(self) -> int | None:
        """The running compile's worker, if any."""
        w = self._worker
        return w.pid if w is not None else None
