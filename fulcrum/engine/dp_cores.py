"""Data parallel for the offline API: `LLM(data_parallel_size=N)` runs N engine cores, each in a process of its own
with its own KV cache and a share of the CPU cores (the server's engine-core processes, engine/core_proc.py), behind
the interface of one EngineCore, so that LLM drives them as it drives one. A request (all its samples) goes to the
core with the fewest in flight; `step()` returns what any core has finished since the last call. One core (N = 1) is
how an LLM runs whose ranks this process cannot join, another engine holding its torch.distributed group."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import time

import zmq

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.engine.core_client import data_parallel_configs, total_stats
from fulcrum.engine.core_proc import run_engine_core
from fulcrum.engine.messages import (
    ABORT,
    ADD,
    FINISH,
    SHUTDOWN,
    AddRequest,
    SchedulerStats,
    decode_outputs,
    decode_ready,
    encoder,
)
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.errors import EngineDeadError, ModelLoadError
from fulcrum.sampling_params import SamplingParams

STARTUP_TIMEOUT_S = 600
POLL_MS = 50


class DataParallelCores:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_path(
            config.model, config.dtype, config.max_model_len, config.quantization, config.quantization_group_size
        )
        self._dir = tempfile.mkdtemp(prefix="fulcrum-dp-")
        self._ctx = zmq.Context()
        self.procs, self.inputs, self.outputs = [], [], []
        self.stats_of: list[SchedulerStats] = []
        self.owner: dict[str, int] = {}  # request -> core
        self.load: list[int] = []  # samples in flight per core
        self.given: list[int] = []  # samples sent to each core since start
        self._last: tuple[str | None, int] = (None, 0)
        try:
            for i, cfg in enumerate(data_parallel_configs(config)):
                inp, out = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
                inp.bind(f"ipc://{self._dir}/in{i}")
                out.bind(f"ipc://{self._dir}/out{i}")
                proc = mp.get_context("spawn").Process(
                    target=run_engine_core, args=(cfg, f"ipc://{self._dir}/in{i}", f"ipc://{self._dir}/out{i}"),
                    name=f"fulcrum-engine-core-{i}", daemon=cfg.world_size == 1,
                )  # fmt: skip
                proc.start()
                self.procs.append(proc)
                self.inputs.append(inp)
                self.outputs.append(out)
                self.stats_of.append(SchedulerStats())
                self.load.append(0)
                self.given.append(0)
            self.ready = [self._wait_ready(i) for i in range(len(self.procs))]
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = self.ready[0].max_model_len
        self.vocab_size = self.ready[0].vocab_size
        self.num_blocks = sum(r.num_blocks for r in self.ready)

    def _wait_ready(self, i: int):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.outputs[i].poll(200):
            if not self.procs[i].is_alive() or time.monotonic() > deadline:
                raise ModelLoadError(f"engine core {i} did not start (exit code {self.procs[i].exitcode})")
        ready = decode_ready(self.outputs[i].recv())
        if ready.error:
            raise ModelLoadError(f"engine core {i} failed to start: {ready.error}")
        return ready

    # -- the EngineCore interface LLM uses ---------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0):
        # the samples of one prompt (ids "<rid>-<i>" from fan_out, added one after another) share a core, and so
        # the prompt's blocks
        parent = request_id.rsplit("-", 1)[0]
        if self._last[0] == parent:
            core = self._last[1]
        else:
            core = min(range(len(self.procs)), key=lambda c: (self.load[c], c))
        self._last = (parent, core)
        self.owner[request_id] = core
        self.load[core] += 1
        self.given[core] += 1
        msg = AddRequest(request_id, list(prompt_token_ids), params, priority, time.time())
        self.inputs[core].send_multipart([ADD, encoder.encode(msg)])

    def _by_core(self, request_ids: list[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.owner:
                out.setdefault(self.owner[rid], []).append(rid)
        return out

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        for core, ids in self._by_core(request_ids).items():
            self.inputs[core].send_multipart([ABORT, encoder.encode(ids)])
        return []  # their final outputs come back through step()

    def finish_requests(self, request_ids: list[str], stop_reason: str | None = None) -> None:
        for core, ids in self._by_core(request_ids).items():
            self.inputs[core].send_multipart([FINISH, encoder.encode(ids)])

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def step(self) -> list[EngineCoreOutput]:
        """Whatever the cores have sent since the last call (waiting up to POLL_MS for the first)."""
        poller = zmq.Poller()
        for out in self.outputs:
            poller.register(out, zmq.POLLIN)
        got: list[EngineCoreOutput] = []
        timeout = POLL_MS
        while True:
            ready = dict(poller.poll(timeout))
            if not ready:
                break
            timeout = 0
            for i, out in enumerate(self.outputs):
                if out in ready:
                    msg = decode_outputs(out.recv())
                    self.stats_of[i] = msg.stats
                    got.extend(msg.outputs)
        if not got:
            dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                raise EngineDeadError(f"engine core {dead[0]} exited (code {self.procs[dead[0]].exitcode})")
        for o in got:
            if o.finish_reason is not None and o.request_id in self.owner:
                self.load[self.owner.pop(o.request_id)] -= 1
        return got

    def stats(self, step_time: float = 0.0) -> SchedulerStats:
        return total_stats(self.stats_of)

    def shutdown(self) -> None:
        for inp, proc in zip(self.inputs, self.procs):
            if proc.is_alive():
                inp.send_multipart([SHUTDOWN, b""])
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"DataParallelCores({len(self.procs)} cores, {self.num_blocks} blocks)"
