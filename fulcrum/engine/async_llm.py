"""The server's frontend to the engine: tokenizes, sends requests to the engine-core process,
detokenizes and streams outputs back per request, and watches that the core stays alive."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from fulcrum.config import EngineConfig, model_path
from fulcrum.engine.core_proc import run_engine_core
from fulcrum.engine.messages import (
    ABORT,
    ADD,
    FINISH,
    SHUTDOWN,
    AddRequest,
    CoreOutputs,
    CoreReady,
    SchedulerStats,
    decode_outputs,
    decode_ready,
    encoder,
)
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.engine.outputs import RequestOutput
from fulcrum.engine.request import check_request, fan_out
from fulcrum.errors import EngineDeadError, EngineOverloadedError, ModelLoadError, RequestFailedError
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600


class AsyncLLM:
    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024):
        self.config = config
        self.model_path = model_path(config.model)  # the rest of the model's facts come in the core's ready message
        self.tokenizer = load_tokenizer(self.model_path)
        self.processor = OutputProcessor(self.tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = SchedulerStats()
        self.ready: CoreReady | None = None
        self.dead = False
        self.stat_loggers: list = []  # objects with record(core_outputs: CoreOutputs, now: float)
        self.on_dead: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._proc: mp.Process | None = None
        self._loop_task: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> CoreReady:
        self._dir = tempfile.mkdtemp(prefix="fulcrum-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        # a plain socket for input: sends never await, so an abort from a cancelled task still goes out
        self._in = self._sync_ctx.socket(zmq.PUSH)
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(out_addr)
        self._proc = mp.get_context("spawn").Process(
            target=run_engine_core, args=(self.config, in_addr, out_addr), name="fulcrum-engine-core", daemon=True
        )
        self._proc.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not await self._out.poll(500):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                raise ModelLoadError(f"the engine core did not start (exit code {self._proc.exitcode})")
        self.ready = decode_ready(await self._out.recv())
        if self.ready.error:
            raise ModelLoadError(f"the engine core failed to start: {self.ready.error}")
        self._loop_task = asyncio.create_task(self._output_loop())
        return self.ready

    async def shutdown(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        if self._proc and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._in.send_multipart([SHUTDOWN, b""])
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.kill()
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        return not self.dead and self._proc is not None and self._proc.is_alive()

    # -- requests ---------------------------------------------------------------------------------

    def num_waiting(self) -> int:
        """Requests not yet running: the core's last count, plus those it has not reported yet."""
        in_flight = len(self.processor.child_to_parent)
        return max(self.stats.num_waiting, in_flight - self.stats.num_running)

    async def generate(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[tuple[RequestOutput, dict[int, str]]]:
        """Stream (output so far, new text per sample) once per engine step until finished.
        Leaving the iteration early (client gone) aborts the request and frees its blocks."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        rid = request_id or f"req-{next(self._ids)}"
        now = time.time()
        params = check_request(prompt_ids, params, priority, self.ready.max_model_len, self.ready.vocab_size)
        children = fan_out(rid, params)
        # encode before anything is registered, so that a failure here holds no queue slot
        msgs = [encoder.encode(AddRequest(cid, prompt_ids, cp, priority, now)) for cid, cp in children]
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        self.processor.add_request(rid, prompt, list(prompt_ids), params, [cid for cid, _ in children])
        finished = False
        try:
            for m in msgs:
                self._in.send_multipart([ADD, m])
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                ro = item[0]
                finished = ro.finished
                failed = next((o for o in ro.outputs if o.finish_reason == "error"), None)
                if failed is not None:
                    raise RequestFailedError(failed.error or "the engine failed on this request")
                yield item
                if finished:
                    return
        finally:
            # every path, an exception between registering and sending included, releases what it holds
            self.queues.pop(rid, None)
            if not finished:
                await self.abort(rid)

    def cut_all(self, error: Exception) -> list[tuple[str, int]]:
        """End every request in flight with `error` (shutdown past the drain timeout); returns each one's
        id and the tokens it had generated. Their iterators raise it, and their `finally` aborts them."""
        cut = []
        for rid, q in list(self.queues.items()):
            parent = self.processor.parents.get(rid)
            tokens = sum(len(c.out.token_ids) for c in parent.children.values()) if parent else 0
            cut.append((rid, tokens))
            q.put_nowait(error)
        return cut

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    async def abort(self, request_id: str) -> None:
        children = self.processor.abort(request_id)
        if children and not self.dead:
            self._in.send_multipart([ABORT, encoder.encode(children)])

    # -- the output loop ---------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._out.poll(1000):
                    if not self._proc.is_alive():
                        raise EngineDeadError(f"the engine core exited (code {self._proc.exitcode})")
                    continue
                msg: CoreOutputs = decode_outputs(await self._out.recv())
                now = time.time()
                self.stats = msg.stats
                for logger in self.stat_loggers:
                    logger.record(msg, now)
                results, stop_now = self.processor.process(msg.outputs)
                for ro, deltas in results:
                    q = self.queues.get(ro.request_id)
                    if q is not None:
                        q.put_nowait((ro, deltas))
                if stop_now:
                    self._in.send_multipart([FINISH, encoder.encode(stop_now)])
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("engine failed: %s", e)
            self.dead = True
            err = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine failed: {e}")
            for q in self.queues.values():
                q.put_nowait(err)
            if self.on_dead:
                self.on_dead()
