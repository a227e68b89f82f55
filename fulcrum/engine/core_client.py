"""The one client of the engine-core processes (engine/core_proc.py), for the offline LLM and the server's AsyncLLM: it
starts the cores (data parallel: one per share of the CPUs), waits for their ready message, sends each request's
samples to the least loaded core as one message, knows which core runs which sample, and gathers outputs and stats.
SyncCoreClient waits by polling, behind EngineCore's interface; AsyncCoreClient waits in asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.engine import kv_event_publisher
from fulcrum.engine.core_proc import run_engine_core
from fulcrum.engine.messages import (
    ABORT,
    ADD,
    FINISH,
    LORA,
    SHUTDOWN,
    AddRequest,
    CallReply,
    CoreOutputs,
    CoreReady,
    LoRACall,
    SchedulerStats,
    decode_outputs,
    decode_ready,
    encoder,
)
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.errors import EngineDeadError, ModelLoadError
from fulcrum.runtime import cpu_threads

STARTUP_TIMEOUT_S = 600
READY_POLL_MS = 200
STEP_POLL_MS = 50  # how long the sync step() waits for a first message
WATCH_MS = 1000  # how often the async face checks that a quiet core is alive


@dataclass(eq=False)
class Core:
    """One engine-core process as the frontend sees it."""

    index: int
    name: str  # as messages name it
    proc: BaseProcess
    inp: zmq.Socket  # a plain socket on both faces: a send never awaits, so an abort from a cancelled task goes out
    out: zmq.Socket  # zmq.asyncio's on the async face
    ready: CoreReady | None = None
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    load: int = 0  # samples in flight on it
    given: int = 0  # samples sent to it since start


class CoreClient:
    """What both faces share: everything but waiting. The processes start here; the faces wait for them."""

    def __init__(self, config: EngineConfig, out_ctx: zmq.Context):
        self.config = config
        self.cores: list[Core] = []
        self.owner: dict[str, Core] = {}  # engine request (a sample) -> the core running it
        self.ready: CoreReady | None = None  # once all are: one model's limits, every core's blocks together
        self.latest_stats = SchedulerStats()  # every core's last stats together
        self._dir = tempfile.mkdtemp(prefix="fulcrum-")
        self._ctx, self._out_ctx = zmq.Context(), out_ctx
        self._stopped = False
        self._call_ids = itertools.count()
        self._replies: dict[int, tuple[str, str, list[CallReply]]] = {}  # LoRA call -> (op, name, replies so far)
        try:
            configs = data_parallel_configs(config)
            for i, cfg in enumerate(configs):
                self.cores.append(self._spawn(i, cfg, len(configs)))
        except BaseException:
            self._stop_processes()
            self._close()
            raise
        self._deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def _spawn(self, i: int, cfg: EngineConfig, n: int) -> Core:
        in_addr, out_addr = f"ipc://{self._dir}/in{i}", f"ipc://{self._dir}/out{i}"
        inp = self._ctx.socket(zmq.PUSH)
        inp.bind(in_addr)
        out = self._out_ctx.socket(zmq.PULL)
        out.bind(out_addr)
        # daemonic unless it starts workers of its own (a parallel engine's ranks), which a daemon may not
        proc = mp.get_context("spawn").Process(
            target=run_engine_core, args=(cfg, in_addr, out_addr), daemon=cfg.world_size == 1,
            name="fulcrum-engine-core" + (f"-{i}" if n > 1 else ""),
        )  # fmt: skip
        proc.start()
        return Core(i, "the engine core" if n == 1 else f"engine core {i}", proc, inp, out)

    # -- the ready handshake (the faces wait for each message) --------------------------------------

    def _check_starting(self, core: Core) -> None:
        """Raise once a core that has not said it is ready never will."""
        if not core.proc.is_alive():
            raise ModelLoadError(f"{core.name} did not start (exit code {core.proc.exitcode})")
        if time.monotonic() > self._deadline:
            raise ModelLoadError(f"{core.name} did not start within {STARTUP_TIMEOUT_S} s")

    def _take_ready(self, core: Core, payload: bytes) -> None:
        core.ready = decode_ready(payload)
        if core.ready.error:
            raise ModelLoadError(f"{core.name} failed to start: {core.ready.error}")

    def _all_ready(self) -> CoreReady:
        blocks = sum(c.ready.num_blocks for c in self.cores)
        self.ready = msgspec.structs.replace(self.cores[0].ready, num_blocks=blocks)
        return self.ready

    # -- requests -----------------------------------------------------------------------------------

    def add_requests(self, samples: list[AddRequest]) -> None:
        """Send one request's samples to the least loaded core as one message: the core takes them together, so their
        prefills run in the same step whatever the timing (their prefill rows, and so their logits' rounding, do not
        depend on a race), and they share the prompt's blocks there."""
        frames = [encoder.encode(s) for s in samples]  # before anything is registered
        core = min(self.cores, key=lambda c: (c.load, c.index))
        for s in samples:
            self.owner[s.request_id] = core
        core.load += len(samples)
        core.given += len(samples)
        core.inp.send_multipart([ADD, *frames])

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Stop these samples; their final outputs come back with the next outputs (EngineCore's returns them)."""
        self._tell(ABORT, request_ids)
        return []

    def finish_requests(self, request_ids: list[str]) -> None:
        """A stop string matched in the frontend: the samples are done, their cores free their blocks now."""
        self._tell(FINISH, request_ids)

    def _tell(self, kind: bytes, request_ids: list[str]) -> None:
        """Forget which core runs these samples (the frontend is done with them) and tell each core of its own."""
        for core, ids in self._release(request_ids).items():
            if core.proc.is_alive():  # a send to a dead core would wait for it forever
                core.inp.send_multipart([kind, encoder.encode(ids)])

    def _release(self, request_ids: list[str]) -> dict[Core, list[str]]:
        by_core: dict[Core, list[str]] = {}
        for rid in request_ids:
            core = self.owner.pop(rid, None)
            if core is not None:
                core.load -= 1
                by_core.setdefault(core, []).append(rid)
        return by_core

    # -- LoRA calls (every core holds every adapter) -------------------------------------------------------------

    def _send_lora(self, op: str, name: str = "", path: str = "", answered: bool = True) -> int:
        """Send a call to every core; `answered`: its replies are gathered (_reply)."""
        call_id = next(self._call_ids)
        if answered:
            self._replies[call_id] = (op, name, [])
        frame = encoder.encode(LoRACall(call_id, op, name, path))
        for core in self.cores:
            core.inp.send_multipart([LORA, frame])
        return call_id

    def _reply(self, call_id: int) -> CallReply | None:
        """The call's answer once every core gave it: the first error, if any (a load that failed on one core is
        undone on the others)."""
        op, name, got = self._replies.get(call_id, ("", "", []))
        if len(got) < len(self.cores):
            return None
        del self._replies[call_id]
        failed = next((r for r in got if r.error), None)
        if failed and op == "load" and any(not r.error for r in got):  # only where it loaded: a name taken stays
            self._send_lora("unload", name, answered=False)
        return failed or got[0]

    def _received(self, core: Core, payload: bytes) -> CoreOutputs:
        """A core's message: its stats kept, its finished samples forgotten, and the stats of all cores in it."""
        msg = decode_outputs(payload)
        for r in msg.replies:
            if r.call_id in self._replies:
                self._replies[r.call_id][2].append(r)
        core.stats = msg.stats
        self.latest_stats = total_stats([c.stats for c in self.cores])
        self._release([o.request_id for o in msg.outputs if o.finish_reason is not None])
        if len(self.cores) > 1:  # whoever counts work from these stats counts every core's
            msg = CoreOutputs(msg.outputs, self.latest_stats, msg.timestamp)
        return msg

    def dead_core(self) -> Core | None:
        return next((c for c in self.cores if not c.proc.is_alive()), None)

    # -- the end ------------------------------------------------------------------------------------

    def _stop_processes(self) -> None:
        """Ask every core to stop, kill any still there after 10 s, and wait for each. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for core in self.cores:
            if core.proc.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    core.inp.send_multipart([SHUTDOWN, b""])
        for core in self.cores:
            core.proc.join(10)
            if core.proc.is_alive():
                core.proc.kill()
                core.proc.join(5)

    def _close(self) -> None:
        self._ctx.destroy(linger=0)
        self._out_ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


class SyncCoreClient(CoreClient):
    """The offline LLM's face: EngineCore's interface over the core processes (data parallel, or a core whose ranks
    this process cannot join); `step()` returns whatever any core has sent since the last call."""

    def __init__(self, config: EngineConfig):
        self.model_config = ModelConfig.from_engine(config)
        super().__init__(config, zmq.Context())
        try:
            for core in self.cores:
                while not core.out.poll(READY_POLL_MS):
                    self._check_starting(core)
                self._take_ready(core, core.out.recv())
        except BaseException:
            self.shutdown()
            raise
        self._all_ready()
        self._early: list[EngineCoreOutput] = []  # outputs read while waiting for a LoRA call's replies
        self._poller = zmq.Poller()
        for core in self.cores:
            self._poller.register(core.out, zmq.POLLIN)

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def num_blocks(self) -> int:
        return self.ready.num_blocks

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def lora(self, op: str, name: str = "", path: str = "") -> CallReply:
        """A LoRA call to every core, answered once all replied (outputs that come meanwhile wait for step())."""
        call_id = self._send_lora(op, name, path)
        while (reply := self._reply(call_id)) is None:
            for core in self.cores:
                if core.out.poll(STEP_POLL_MS):
                    self._early.extend(self._received(core, core.out.recv()).outputs)
            if (dead := self.dead_core()) is not None:
                raise EngineDeadError(f"{dead.name} exited (code {dead.proc.exitcode})")
        return reply

    def step(self) -> list[EngineCoreOutput]:
        """What the cores have sent since the last call, waiting up to STEP_POLL_MS for the first message."""
        got, self._early = self._early, []
        timeout = 0 if got else STEP_POLL_MS
        while ready := dict(self._poller.poll(timeout)):
            timeout = 0
            for core in self.cores:
                if core.out in ready:
                    got.extend(self._received(core, core.out.recv()).outputs)
        if not got and (dead := self.dead_core()) is not None:
            raise EngineDeadError(f"{dead.name} exited (code {dead.proc.exitcode})")
        return got

    def stats(self) -> SchedulerStats:
        return self.latest_stats

    def shutdown(self) -> None:
        if not self._stopped:
            self._stop_processes()
            self._close()

    def __repr__(self) -> str:
        return f"SyncCoreClient({len(self.cores)} cores, {self.num_blocks} blocks)"


class AsyncCoreClient(CoreClient):
    """The server's face: `start()` awaits the cores' ready messages, then a task per core reads its messages into
    one queue that `get_output()` takes from."""

    def __init__(self, config: EngineConfig):
        super().__init__(config, zmq.asyncio.Context())
        self._outputs: asyncio.Queue[CoreOutputs | Exception] = asyncio.Queue()
        self._readers: list[asyncio.Task] = []
        self._calls: dict[int, asyncio.Future] = {}

    async def start(self) -> CoreReady:
        try:
            for core in self.cores:
                while not await core.out.poll(READY_POLL_MS):
                    self._check_starting(core)
                self._take_ready(core, await core.out.recv())
        except BaseException:
            await self.shutdown()
            raise
        self._readers = [asyncio.create_task(self._read(c)) for c in self.cores]
        return self._all_ready()

    @property
    def alive(self) -> bool:
        return bool(self.cores) and not self._stopped and self.dead_core() is None

    async def lora(self, op: str, name: str = "", path: str = "") -> CallReply:
        """A LoRA call to every core, answered once all replied."""
        call_id = self._send_lora(op, name, path)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            reply = await future
        finally:
            self._calls.pop(call_id, None)
        return reply

    def _received(self, core: Core, payload: bytes) -> CoreOutputs:
        msg = super()._received(core, payload)
        for call_id, future in list(self._calls.items()):
            reply = self._reply(call_id)
            if reply is not None and not future.done():
                future.set_result(reply)
        return msg

    async def get_output(self) -> CoreOutputs:
        """The next message of any core; raises what ended a core's reader (EngineDeadError when the core died)."""
        item = await self._outputs.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def _read(self, core: Core) -> None:
        try:
            while True:
                try:  # a message already there is taken at once; a poll (which costs more) only waits for one
                    payload = await core.out.recv(zmq.NOBLOCK)
                except zmq.Again:
                    if not await core.out.poll(WATCH_MS) and not core.proc.is_alive():
                        raise EngineDeadError(f"{core.name} exited (code {core.proc.exitcode})") from None
                    continue
                self._outputs.put_nowait(self._received(core, payload))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._outputs.put_nowait(e)

    async def shutdown(self) -> None:
        if self._stopped:
            return
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._stop_processes)
        self._close()  # in the loop's thread, where the asyncio sockets live


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
            setattr(out, f.name, _add_lists(values))
        elif all(isinstance(v, dict) for v in values):  # named counts (or lists of them): added name by name
            keys = dict.fromkeys(k for v in values for k in v)
            merged = {k: [v[k] for v in values if k in v] for k in keys}
            setattr(
                out, f.name, {k: _add_lists(vs) if isinstance(vs[0], list) else sum(vs) for k, vs in merged.items()}
            )
    return out


def _add_lists(values: list[list]) -> list:
    return [sum(col) for col in itertools.zip_longest(*values, fillvalue=0)]


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
                    kv_events_config=kv_event_publisher.for_rank(config.kv_events_config, i))
            for i in range(n)
        ]  # fmt: skip
    return [
        replace(config, cpu_bind=",".join(map(str, cpus[i * share : (i + 1) * share])), cpu_threads=share,
                kv_events_config=kv_event_publisher.for_rank(config.kv_events_config, i))
        for i in range(n)
    ]  # fmt: skip
