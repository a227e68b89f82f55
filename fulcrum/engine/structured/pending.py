"""Requests whose grammar is compiling: they wait here, outside the scheduler, until it is ready."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from fulcrum.engine.request import Request, RequestStatus
from fulcrum.engine.structured.grammar import StructuredOutputs, compile_timeout_s


class PendingGrammars:
    """A request joins when it has a grammar to compile and leaves ready (its GrammarState set), failed (its spec
    cannot be compiled, or not within --grammar-compile-timeout: the request's fault, a 400), or dropped (aborted or
    stopped, its compile stopped with it)."""

    def __init__(self, structured: StructuredOutputs):
        self.structured = structured
        self._pending: dict[str, tuple[Request, Future]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def requests(self) -> list[Request]:
        """The requests whose grammar compiles."""
        return [req for req, _ in self._pending.values()]

    def add(self, req: Request) -> None:
        self._pending[req.request_id] = (req, self.structured.submit(req.sampling_params.structured_outputs))

    def drop(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        dropped = []
        for rid in request_ids:
            if rid in self._pending:
                req, future = self._pending.pop(rid)
                self.structured.abandon(future)
                req.status = status
                dropped.append(req)
        return dropped

    def take(self) -> tuple[list[Request], list[Request]]:
        """The requests whose grammar is ready, and those that failed (each with its error)."""
        ready, failed = [], []
        now = time.monotonic()
        for rid, (req, future) in list(self._pending.items()):
            if not future.done():
                if now > future.deadline:  # the request ends, and its compile is stopped
                    del self._pending[rid]
                    self.structured.abandon(future)
                    failed.append(_failed(req, f"the grammar did not compile within {compile_timeout_s():g} s "
                                               "(fulcrum serve --grammar-compile-timeout); simplify the schema or "
                                               "grammar"))  # fmt: skip
                continue
            del self._pending[rid]
            try:
                req.grammar = future.result()
            except Exception as e:
                failed.append(_failed(req, f"the grammar cannot be compiled: {e}"))
                continue
            ready.append(req)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Until a compile ends or `timeout` passes (an idle core waits here instead of spinning)."""
        wait([f for _, f in self._pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)


def _failed(req: Request, error: str) -> Request:
    req.status, req.error_status, req.error = RequestStatus.FINISHED_ERROR, 400, error
    return req
