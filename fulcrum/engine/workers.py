"""The ranks of one parallel engine (tensor x pipeline parallel): rank 0 is the engine core itself (scheduler,
sampler, last pipeline stage); the others are workers, spawned as processes (`mp`, gloo on CPU, NCCL on CUDA) or Ray
actors (`ray`, across a cluster's machines). A worker that fails at startup is an error naming it, never a hang; one
that dies later makes the engine fatal (WorkerDiedError), noticed by a watcher thread between steps too."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.distributed import parallel_state
from fulcrum.errors import ModelLoadError, WorkerDiedError

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def backend_for(config: EngineConfig) -> str:
    return "nccl" if str(config.device).startswith("cuda") else "gloo"


def check_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """Sizes that cannot split this model fail before any process starts, with the numbers."""
    cfg, tp, pp = model_config.hf_config, config.tensor_parallel_size, config.pipeline_parallel_size
    problems = []
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}")
    if kv_heads and tp > 1 and kv_heads % tp and tp % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} neither divides nor is divisible by tensor_parallel_size={tp}")
    for name in ("intermediate_size", "moe_intermediate_size"):
        size = getattr(cfg, name, None)
        if size and size % tp and not (name == "moe_intermediate_size" and config.enable_expert_parallel):
            problems.append(f"{name}={size} is not divisible by tensor_parallel_size={tp}")
    layers = cfg.num_hidden_layers
    try:
        parallel_state.stage_sizes(layers, pp, config.pp_layer_partition)
    except ValueError as e:
        problems.append(str(e))
    if config.device == "cuda" and torch.cuda.is_available() and config.world_size > torch.cuda.device_count():
        problems.append(f"{config.world_size} ranks need as many GPUs; this machine has {torch.cuda.device_count()}")
    if problems:
        raise ModelLoadError("cannot split the model this way: " + "; ".join(problems))


def join(config: EngineConfig, rank: int, init_method: str) -> None:
    """This process becomes `rank` of the engine's torch.distributed world."""
    if str(config.device).startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    parallel_state.init_distributed(
        rank, config.tensor_parallel_size, config.pipeline_parallel_size, init_method, backend_for(config),
        config.enable_expert_parallel, config.pp_layer_partition,
    )  # fmt: skip


def _agree_from_rank0(num_blocks: int, report) -> int:
    """A worker's KV block count goes to rank 0, which broadcasts the smallest of them all."""
    report(("loaded", num_blocks))
    kind, agreed = parallel_state.broadcast_control()
    assert kind == "blocks"
    return agreed


def run_worker(config: EngineConfig, rank: int, init_method: str, report) -> None:
    """A worker's life: join, load its part, then run the steps rank 0 broadcasts until told to stop."""
    from fulcrum.engine.model_runner import ModelRunner  # the heavy imports, in the worker only

    join(config, rank, init_method)
    model_config = ModelConfig.from_engine(config)
    runner = ModelRunner(config, model_config, own_process=True, agree_blocks=lambda n: _agree_from_rank0(n, report))
    with torch.inference_mode():
        while True:
            msg = parallel_state.broadcast_control()
            if msg is None:
                break
            kind, steps = msg
            runner.forward_logits(steps)
    parallel_state.destroy()


def _mp_worker(config: EngineConfig, rank: int, init_method: str, conn) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker-{rank} %(levelname)s %(message)s")
    parent = os.getppid()

    def watch_parent():  # rank 0 gone (even killed): do not linger as an orphan
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        conn.send(("alive", None))
        run_worker(config, rank, init_method, conn.send)
    except Exception as e:
        log.error("worker %d failed:\n%s", rank, traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)


@dataclass
class _Worker:
    rank: int
    handle: object  # a multiprocessing Process, or a Ray actor
    conn: object | None = None  # mp: the pipe it reports on
    loop_ref: object | None = None  # ray: its run loop's result


class Workers:
    """The workers of one engine, seen from rank 0 (the engine core). Startup: every worker reports that it is alive
    before anyone joins torch.distributed, then its KV block count once its part of the model is loaded; rank 0 waits
    on those reports watching the workers. Steps: rank 0 broadcasts each step's inputs (engine/step_inputs.py) over
    the gloo control group; a worker runs its layers and waits for the next."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, exit_on_death: bool = False):
        """`exit_on_death`: a rank's death ends this process (the engine core runs in a process of its own, whose
        frontend then reports the engine dead) instead of raising in the step."""
        check_parallel(config, model_config)
        self.exit_on_death = exit_on_death
        if parallel_state.held(config.world_size):
            raise ModelLoadError(
                "this process's torch.distributed group is already held (by another parallel engine, or the caller): "
                "close() that engine first, or run this one in a process of its own"
            )
        self.config, self.backend = config, config.distributed_executor_backend or "mp"
        self.world = config.world_size
        self.workers: list[_Worker] = []
        self.died: str | None = None
        self._stopping = False
        self._joined = False  # this process's torch.distributed is ours to take down (held() was false before)
        if self.backend == "ray":
            self._start_ray()
        else:
            self._start_mp()
        atexit.register(self.shutdown)

    # -- startup -----------------------------------------------------------------------------------

    def _start_mp(self) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world):
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(  # daemonic: ended with rank 0's process even if it never shuts them down
                target=_mp_worker, args=(self.config, rank, init_method, theirs), name=f"fulcrum-worker-{rank}",
                daemon=True,
            )  # fmt: skip
            proc.start()
            theirs.close()
            self.workers.append(_Worker(rank, proc, ours))
        try:
            for w in self.workers:
                self._expect(w, "alive")
            self._joined = True
            join(self.config, 0, init_method)
        except BaseException:
            self.shutdown()
            raise

    def _start_ray(self) -> None:
        from fulcrum.engine import ray_workers

        self._ray = ray_workers.RayCluster(self.config, self.world - 1)
        init_method = f"tcp://{self._ray.driver_ip}:{free_port()}"
        self.workers = [_Worker(rank, actor) for rank, actor in enumerate(self._ray.actors, start=1)]
        try:
            self._ray.start(init_method)
            self._joined = True
            join(self.config, 0, init_method)
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, w: _Worker, kind: str):
        """The next report of an mp worker, which must be `kind`; an error, an exit or the timeout raise."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not w.conn.poll(0.2):
            if not w.handle.is_alive():
                raise ModelLoadError(f"worker {w.rank} exited during startup (exit code {w.handle.exitcode})")
            if time.monotonic() > deadline:
                raise ModelLoadError(f"worker {w.rank} did not start within {STARTUP_TIMEOUT_S} s")
        got, value = w.conn.recv()
        if got == "error":
            raise ModelLoadError(f"worker {w.rank} failed to start: {value}")
        return value

    def agree_blocks(self, num_blocks: int) -> int:
        """Rank 0's side of the KV block agreement: every worker's count, then the smallest to all."""
        try:
            if self.backend == "ray":
                counts = self._ray.loaded_blocks()
            else:
                counts = [self._expect(w, "loaded") for w in self.workers]
        except BaseException:
            self.shutdown()
            raise
        agreed = min([num_blocks, *counts])
        parallel_state.broadcast_control(("blocks", agreed))
        threading.Thread(target=self._watch, daemon=True, name="fulcrum-worker-watch").start()
        return agreed

    # -- running -----------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Notice a worker's death even between steps: the engine is then dead (the next step raises), and where the
        core has a process of its own (fulcrum serve) it exits, so the frontend fails what was in flight."""
        while not self._stopping:
            if self.backend == "ray":
                gone = [f"worker {r} ended" for r in self._ray.dead_ranks()]
            else:
                gone = [f"worker {w.rank} exited with code {w.handle.exitcode}" for w in self.workers
                        if not w.handle.is_alive()]  # fmt: skip
            if gone and not self._stopping:
                self.died = gone[0]
                log.error("%s; the engine cannot go on", self.died)
                if self.exit_on_death:
                    os._exit(1)
                return
            time.sleep(0.2)

    def check(self) -> None:
        if self.died:
            raise WorkerDiedError(self.died)

    def shutdown(self) -> None:
        """Stop the workers and leave torch.distributed as it was before this engine (so another can start)."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self._joined and parallel_state.state().world_size > 1 and not self.died:
            with contextlib.suppress(Exception):  # a worker already gone: the others see the failure and exit too
                parallel_state.broadcast_control(None)
        if self.backend == "ray":
            self._ray.shutdown()
        else:
            for w in self.workers:
                w.handle.join(5)
                if w.handle.is_alive():
                    w.handle.kill()
                    w.handle.join(5)
                w.conn.close()
        if self._joined:
            parallel_state.destroy()
