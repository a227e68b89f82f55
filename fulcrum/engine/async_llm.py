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
from dataclasses import dataclass, field, replace

import msgspec
import zmq
import zmq.asyncio

from fulcrum.config import EngineConfig, model_path
from fulcrum.engine import kv_events
from fulcrum.engine.core_proc import run_engine_core
from fulcrum.engine.kv_transfer import KVTransferConfig, KVTransferError, check_remote_prefill
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
from fulcrum.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RequestFailedError,
)
from fulcrum.kernels import cpu_threads
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600


class AsyncLLM:
    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024):
        self.config = config
        self.kv_trust = KVTransferConfig.parse(config.kv_transfer_config)  # which producers a consumer may contact
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
        self.cores: list[_Core] = []
        self._owner: dict[str, _Core] = {}  # engine request (a sample) -> the core running it
        self._loop_tasks: list[asyncio.Task] = []

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> CoreReady:
        """Start the engine core(s): one process each (data parallel: `data_parallel_size` of them, each with its
        own KV cache and a share of the cores), and wait until all are ready."""
        self._dir = tempfile.mkdtemp(prefix="fulcrum-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        configs = data_parallel_configs(self.config)
        for i, cfg in enumerate(configs):
            in_addr, out_addr = f"ipc://{self._dir}/in{i}", f"ipc://{self._dir}/out{i}"
            # a plain socket for input: sends never await, so an abort from a cancelled task still goes out
            inp = self._sync_ctx.socket(zmq.PUSH)
            inp.bind(in_addr)
            out = self._ctx.socket(zmq.PULL)
            out.bind(out_addr)
            name = "fulcrum-engine-core" + (f"-{i}" if len(configs) > 1 else "")
            # daemonic unless it starts workers of its own (a parallel engine's ranks), which a daemon may not
            proc = mp.get_context("spawn").Process(
                target=run_engine_core, args=(cfg, in_addr, out_addr), name=name, daemon=cfg.world_size == 1
            )
            proc.start()
            self.cores.append(_Core(i, proc, inp, out))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for core in self.cores:
            while not await core.out.poll(500):
                if not core.proc.is_alive() or time.monotonic() > deadline:
                    raise ModelLoadError(f"the engine core did not start (exit code {core.proc.exitcode})")
            core.ready = decode_ready(await core.out.recv())
            if core.ready.error:
                raise ModelLoadError(f"the engine core failed to start: {core.ready.error}")
        first = self.cores[0].ready
        # what the server reports: one model's limits, the cache of every core together
        self.ready = msgspec.structs.replace(first, num_blocks=sum(c.ready.num_blocks for c in self.cores))
        self._loop_tasks = [asyncio.create_task(self._output_loop(c)) for c in self.cores]
        return self.ready

    async def shutdown(self) -> None:
        for t in self._loop_tasks:
            t.cancel()
        loop = asyncio.get_running_loop()
        for core in self.cores:
            if core.proc.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    core.inp.send_multipart([SHUTDOWN, b""])
        for core in self.cores:
            await loop.run_in_executor(None, core.proc.join, 10)
            if core.proc.is_alive():
                core.proc.kill()
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        return not self.dead and bool(self.cores) and all(c.proc.is_alive() for c in self.cores)

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
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[tuple[RequestOutput, dict[int, str]]]:
        """Stream (output so far, new text per sample) once per engine step until finished.
        Leaving the iteration early (client gone) aborts the request and frees its blocks.
        `kv_transfer_params`: vLLM's P/D handshake, checked here (engine/kv_transfer/config.py)."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        rid = request_id or f"req-{next(self._ids)}"
        now = time.time()
        params = check_request(prompt_ids, params, priority, self.ready.max_model_len, self.ready.vocab_size)
        if kv_transfer_params is not None:
            check_kv_transfer(kv_transfer_params, self.ready.kv_transfer, prompt_ids, params, self.kv_trust)
        children = fan_out(rid, params)
        # encode before anything is registered, so that a failure here holds no queue slot
        msgs = [
            encoder.encode(AddRequest(cid, prompt_ids, cp, priority, now, kv_transfer_params)) for cid, cp in children
        ]
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        self.processor.add_request(rid, prompt, list(prompt_ids), params, [cid for cid, _ in children])
        # the least loaded core takes all the samples, which share the prompt's blocks there
        core = min(self.cores, key=lambda c: (c.load, c.index))
        for cid, _ in children:
            self._owner[cid] = core
        core.load += len(children)
        core.given += len(children)
        finished = False
        try:
            # one multipart message: the core takes a request's samples together, so they are scheduled in the same
            # step whatever the timing (their prefill rows, and so their logits' rounding, do not depend on a race)
            core.inp.send_multipart([ADD, *msgs])
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                ro = item[0]
                finished = ro.finished
                failed = next((o for o in ro.outputs if o.finish_reason == "error"), None)
                if failed is not None:
                    if failed.error_status == 400:  # the request's own fault: its grammar cannot be compiled
                        raise InvalidRequestError(failed.error)
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
        for core, ids in self._release(children).items():
            if not self.dead:
                core.inp.send_multipart([ABORT, encoder.encode(ids)])

    def _release(self, child_ids: list[str]) -> dict[_Core, list[str]]:
        """Forget which core ran these samples (they are done); returns them grouped by core."""
        by_core: dict[_Core, list[str]] = {}
        for cid in child_ids:
            core = self._owner.pop(cid, None)
            if core is not None:
                core.load -= 1
                by_core.setdefault(core, []).append(cid)
        return by_core

    # -- the output loop ---------------------------------------------------------------------------

    async def _output_loop(self, core: _Core) -> None:
        try:
            while True:
                if not await core.out.poll(1000):
                    if not core.proc.is_alive():
                        raise EngineDeadError(f"the engine core exited (code {core.proc.exitcode})")
                    continue
                msg: CoreOutputs = decode_outputs(await core.out.recv())
                now = time.time()
                core.stats = msg.stats
                self.stats = total_stats([c.stats for c in self.cores])
                if len(self.cores) > 1:  # the loggers count every core's work: give them the totals
                    msg = CoreOutputs(msg.outputs, self.stats, msg.timestamp)
                self._release([o.request_id for o in msg.outputs if o.finish_reason is not None])
                # processed first: outputs keep only the tokens the frontend took (none past a stop string), which
                # is what the loggers count
                results, stop_now = self.processor.process(msg.outputs)
                for logger in self.stat_loggers:
                    logger.record(msg, now)
                for ro, deltas in results:
                    q = self.queues.get(ro.request_id)
                    if q is not None:
                        q.put_nowait((ro, deltas))
                if stop_now:
                    core.inp.send_multipart([FINISH, encoder.encode(stop_now)])
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


@dataclass(eq=False)
class _Core:
    """One engine-core process as the frontend sees it."""

    index: int
    proc: mp.Process
    inp: zmq.Socket
    out: zmq.asyncio.Socket
    ready: CoreReady | None = None
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    load: int = 0  # samples in flight on it
    given: int = 0  # samples sent to it since start


def check_kv_transfer(
    params: dict, local: dict | None, prompt_ids: list[int], sp: SamplingParams, trust: KVTransferConfig | None = None
) -> None:
    """The frontend's check of a request's kv_transfer_params, so that a refusal is a 400 before it is queued."""
    if not isinstance(params, dict):
        raise KVTransferError("kv_transfer_params must be an object", "kv_transfer_params")
    if local is None:  # a plain engine: the field would do nothing, and a silent 200 would hide the mistake
        raise KVTransferError(
            "kv_transfer_params needs an engine started with --kv-role or --kv-transfer-config", "kv_transfer_params"
        )
    if sp.n != 1:
        raise KVTransferError("kv_transfer_params takes one sample per request (n 1)", "kv_transfer_params")
    if params.get("do_remote_prefill"):
        check_remote_prefill(params, local, prompt_ids, trust)
    elif params.get("do_remote_decode") and local.get("role") == "kv_consumer":
        raise KVTransferError(
            "kv_transfer_params asks for a remote decode, but this engine offers no KV "
            "(start it with --kv-role producer or both)",
            "kv_transfer_params",
        )


def total_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The cores' gauges and cumulative counters added up (KV usage over all their blocks; the slowest step)."""
    if len(stats) == 1:
        return stats[0]
    blocks = sum(s.num_blocks for s in stats)
    out = SchedulerStats(
        kv_cache_usage=sum(s.kv_cache_usage * s.num_blocks for s in stats) / blocks if blocks else 0.0,
        step_time=max(s.step_time for s in stats),
    )
    for f in msgspec.structs.fields(SchedulerStats):
        if f.name in ("kv_cache_usage", "step_time"):
            continue
        values = [getattr(s, f.name) for s in stats]
        if all(isinstance(v, int) for v in values):
            setattr(out, f.name, sum(values))
        elif all(isinstance(v, list) for v in values):  # per-position counts: added position by position
            setattr(out, f.name, [sum(col) for col in itertools.zip_longest(*values, fillvalue=0)])
    return out


def data_parallel_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per data-parallel engine core: each gets a contiguous share of this process's cores (with the
    automatic binding; a given --cpu-bind is split the same way), or none pinned when there are more cores than
    CPUs."""
    n = config.data_parallel_size
    if n == 1:
        return [config]
    cpus = cpu_threads.parse_cpus(config.cpu_bind) if config.cpu_bind not in ("auto", "none") else None
    cpus = cpus or cpu_threads.allowed_cpus()
    share = len(cpus) // n
    if config.cpu_bind == "none" or share == 0:
        return [
            replace(config, cpu_bind="none", cpu_threads=config.cpu_threads or 1,
                    kv_events_config=kv_events.for_rank(config.kv_events_config, i))
            for i in range(n)
        ]  # fmt: skip
    return [
        replace(config, cpu_bind=",".join(map(str, cpus[i * share : (i + 1) * share])), cpu_threads=share,
                kv_events_config=kv_events.for_rank(config.kv_events_config, i))
        for i in range(n)
    ]  # fmt: skip
