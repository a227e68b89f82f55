"""The calibration's sweep: an engine built as `fulcrum serve` builds its core, in a process of its own (its pinned
threads never reach the caller's), driven through small workloads by `EngineCore.step()`: decode rows over short
and long contexts, prefill chunks with and without a cached prefix, decodes mixed with a chunk. Each step's shape is
read from the scheduler's output before the step runs, and the whole `step()` call is timed (schedule, forward,
sample, update: the period a live engine has)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context

from fulcrum.plan.step_costs import StepShape


@dataclass(frozen=True)
class Sweep:
    """The workloads of a calibration. Decode: `rows` requests whose prompts of `context` tokens are prefilled,
    then decoded together for `decode_steps` steps (a grid point is skipped when rows x context passes
    `max_kv_tokens`: its prefill would dominate the run). Prefill: one chunk of each size, fresh and after a cached
    prefix. Mixed: (rows decoding, chunk) in one step. Each workload runs `repeats` times."""

    rows: tuple[int, ...]
    contexts: tuple[int, ...]
    max_kv_tokens: int
    decode_steps: int
    chunks: tuple[int, ...]
    mixed: tuple[tuple[int, int], ...]
    repeats: int


SWEEPS = {
    "default": Sweep(
        rows=(1, 2, 4, 8, 16, 32, 64),
        contexts=(32, 256, 1024),
        max_kv_tokens=16384,
        decode_steps=16,
        chunks=(16, 32, 64, 128, 256, 512, 1024, 2048),
        mixed=((1, 64), (4, 256), (8, 32), (16, 1024), (32, 128), (64, 512)),
        repeats=3,
    ),
    "quick": Sweep(
        rows=(1, 4, 16),
        contexts=(32, 256),
        max_kv_tokens=4096,
        decode_steps=8,
        chunks=(16, 64, 256, 1024),
        mixed=((4, 128), (16, 512)),
        repeats=2,
    ),
}


class StepRecorder:
    """Wraps the scheduler's `schedule` so that each step's shape is taken from its output before the step runs
    (a row's num_computed_tokens moves in update)."""

    def __init__(self, core):
        self.shape: StepShape | None = None
        schedule = core.scheduler.schedule

        def recorded():
            out = schedule()
            shape = StepShape()
            for s in out.scheduled:
                shape.add(s.num_new_tokens, s.request.num_computed_tokens, s.samples_next_token)
            self.shape = shape if out.scheduled else None
            return out

        core.scheduler.schedule = recorded


class Runner:
    """Drives an EngineCore through workloads, keeping every step's (shape, seconds)."""

    def __init__(self, core, seed: int = 0):
        from fulcrum.sampling_params import SamplingParams

        self.core, self.rec, self.rng = core, StepRecorder(core), random.Random(seed)
        # greedy, as `fulcrum bench serve` and `fulcrum tune` send by default: temperature > 0 samples through a
        # softmax over the vocabulary per row (about 4.5 ms a row at the 0.5B shape's 151,936 tokens on one core),
        # greedy takes the argmax kernel, and the two costs differ too much for one model to serve both
        self.params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        self.steps: list[tuple[StepShape, float]] = []
        self.n = 0

    def prompt(self, length: int) -> list[int]:
        # ids from 10 up: clear of the special tokens of small vocabularies
        return [self.rng.randrange(10, self.core.vocab_size) for _ in range(length)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.n += 1
        rid = f"calibrate-{self.n}"
        self.core.add_request(rid, prompt, self.params(max_tokens))
        return rid

    def step(self) -> None:
        self.rec.shape = None
        t0 = time.perf_counter()
        self.core.step()
        dt = time.perf_counter() - t0
        if self.rec.shape is not None:
            self.steps.append((self.rec.shape, dt))

    def drain(self) -> None:
        while self.core.has_unfinished_requests():
            self.step()

    def decode(self, rows: int, context: int, decode_steps: int) -> None:
        prefill_steps = math.ceil(rows * context / self.core.config.max_num_batched_tokens)
        for _ in range(rows):
            self.add(self.prompt(context), prefill_steps + decode_steps)
        self.drain()

    def prefill(self, chunk: int, cached: bool) -> None:
        """A step of `chunk` new tokens (over several prompts where it passes the context), after a cached prefix
        of as many tokens when `cached` and the context has room."""
        limit = self.core.max_model_len - 1
        parts = math.ceil(chunk / limit)
        sizes = [chunk // parts + (i < chunk % parts) for i in range(parts)]
        prefixes = [self.prompt(n) if cached and 2 * n <= limit else [] for n in sizes]
        for p in prefixes:
            if p:
                self.add(p, 1)
        self.drain()
        for p, n in zip(prefixes, sizes):
            self.add(p + self.prompt(n), 1)
        self.drain()

    def mixed(self, rows: int, chunk: int) -> None:
        """`rows` decoding when a prompt of `chunk` tokens arrives: its prefill shares their steps."""
        chunk = min(chunk, self.core.max_model_len - 1)
        ids = [self.add(self.prompt(32), self.core.max_model_len - 33) for _ in range(rows)]
        while any(r.num_output_tokens == 0 for r in self.core.scheduler.requests.values()):
            self.step()
        last = self.add(self.prompt(chunk), 2)
        while last in self.core.scheduler.requests:
            self.step()
        self.core.abort_requests(ids)
        self.drain()


def decode_grid(sweep: Sweep, max_num_seqs: int, max_model_len: int, kv_tokens: int) -> list[tuple[int, int]]:
    """The (rows, context) points that fit the engine: its sequences, its context (less the decode steps and the
    staggered prefill) and its KV cache."""
    out = []
    for c in sweep.contexts:
        context = min(c, max_model_len - sweep.decode_steps - 40)
        for r in sweep.rows:
            if r <= max_num_seqs and r * context <= sweep.max_kv_tokens and r * (context + 64) <= kv_tokens:
                out.append((r, context))
    return out


def _sweep_process(conn, settings: dict, sweep: Sweep, own_process: bool) -> None:
    """The engine's process: runs the sweep, sending its progress lines and then the result (or the error, as one
    line: an exception may not survive the trip between processes)."""
    try:
        conn.send(("done", run_sweep(settings, sweep, own_process, lambda line: conn.send(("say", line)))))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
    finally:
        conn.close()


def sweep_in_own_process(settings: dict, sweep: Sweep, own_process: bool, say: Callable[[str], None]) -> dict:
    """`run_sweep` in a spawned process, as `fulcrum serve` runs its engine core: its threads are placed there and
    never reach the caller's (a pinned caller would pass its one core to every process it starts later)."""
    ctx = get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_sweep_process, args=(send, settings, sweep, own_process), name="fulcrum-calibrate")
    proc.start()
    send.close()
    try:
        while True:
            try:
                kind, value = recv.recv()
            except EOFError:
                proc.join(10)
                raise ValueError(f"the engine's process ended while calibrating (exit code {proc.exitcode})") from None
            if kind != "say":
                break
            say(value)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if kind == "error":
        raise ValueError(f"the engine failed while calibrating: {value}")
    return value


def run_sweep(settings: dict, sweep: Sweep, own_process: bool, say: Callable[[str], None]) -> dict:
    """Build the engine and run the sweep: the steps, what the engine is, and its KV block's bytes."""
    import torch

    from fulcrum.config import EngineConfig
    from fulcrum.engine.core import EngineCore

    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(**settings), own_process=own_process)
    threads = torch.get_num_threads()
    say(f"  engine up in {time.perf_counter() - t0:.1f} s: {core.kv.num_blocks} KV blocks, {threads} threads")
    cfg, run = core.config, Runner(core)
    run.decode(4, 32, 4)  # warm-up: kernels, allocator, first touches of the cache
    run.prefill(min(512, cfg.max_num_batched_tokens), cached=True)
    run.steps.clear()
    grid = decode_grid(sweep, cfg.max_num_seqs, core.max_model_len, core.kv.num_blocks * cfg.block_size)
    chunks = [c for c in sweep.chunks if c <= cfg.max_num_batched_tokens]
    mixed = [(r, c) for r, c in sweep.mixed if r < cfg.max_num_seqs and r + c <= cfg.max_num_batched_tokens]
    passes = []
    for i in range(sweep.repeats):
        t = time.perf_counter()
        for rows, context in grid:
            run.decode(rows, context, sweep.decode_steps)
        for chunk in chunks:
            run.prefill(chunk, cached=False)
            run.prefill(chunk, cached=True)
        for rows, chunk in mixed:
            run.mixed(rows, chunk)
        passes.append(time.perf_counter() - t)
        say(f"  pass {i + 1}/{sweep.repeats}: {len(run.steps)} steps so far ({passes[-1]:.1f} s)")
    engine = {
        "model": str(core.model_config.path),
        "dtype": str(core.model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": core.runner.kv_cache_dtype_name,
        "quantization": cfg.quantization,
        "quantization_group_size": cfg.quantization_group_size if cfg.quantization else None,
        "block_size": cfg.block_size,
        "num_blocks": core.kv.num_blocks,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,  # the sweep's (its largest chunk)
        "max_model_len": core.max_model_len,
        "device": cfg.device,
        "threads": threads,
        "pinned": own_process,
        "sampling": "greedy",
    }
    steps = [(s.as_dict(), t) for s, t in run.steps]
    block_bytes = core.runner.bytes_per_block
    core.shutdown()
    return {"steps": steps, "engine": engine, "block_bytes": block_bytes, "pass_seconds": passes}
