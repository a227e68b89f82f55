"""Calibration (`fulcrum sim calibrate`): the engine's real steps measured on this machine and the step-cost model
(`fulcrum.plan.step_costs`) fitted to them, with its error on steps it was not fitted to.

The steps come from `step_sweep` (the engine as `fulcrum serve` builds its core, in a process of its own). Distinct
step shapes keep their fastest repeat; four fifths of them are fitted and the rest measure the model's error. A real
server's TTFT gives the frontend's share (`frontend_s`), and the host's copy rate the KV transfer's."""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

from fulcrum.defaults import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    serve_max_num_batched_tokens,
)
from fulcrum.plan.step_costs import StepCosts, StepShape, errors, fit, prefill_seconds
from fulcrum.probe.step_sweep import SWEEPS, sweep_in_own_process
from fulcrum.utils import cpu_isa
from fulcrum.utils.serve_process import start

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
HELD_OUT = 5  # one distinct step shape in five is held out of the fit


# -- where a calibration is kept ------------------------------------------------------------------------------


def cache_root() -> Path:
    """FULCRUM_CACHE (the kernels' and GGUF folders' cache too), else ~/.cache/fulcrum."""
    return Path(os.environ.get("FULCRUM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fulcrum")))


def _dtype_name(model: str | Path | None, dtype: str) -> str:
    """fp32 / bf16 / fp16, with "auto" read from the model's config.json as the engine reads it."""
    if dtype == "auto":
        try:
            cfg = json.loads((Path(model or DEFAULT_MODEL) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            cfg = {}
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return DTYPE_NAMES.get(dtype, dtype)


def default_costs_path(
    model: str | Path | None,
    dtype: str,
    kv_cache_dtype: str,
    threads: int | None = None,
    quantization: str | None = None,
    quantization_group_size: int = 128,
) -> Path:
    """`$FULCRUM_CACHE/step-costs/<model>-<dtype>-kv<kv>[-<quantization>]-<threads>t-<isa>.json`: one file per
    engine setting that changes a step's cost on this machine (the ISA level fulcrum's kernels run at). `threads`
    None: the compute threads `fulcrum serve` gives its engine here."""
    threads = threads or engine_threads(own_process=True)
    name = Path(model or DEFAULT_MODEL).expanduser().resolve().name
    weights = _dtype_name(model, dtype)
    kv = {"auto": weights, "fp8_e4m3": "fp8"}.get(kv_cache_dtype, kv_cache_dtype)
    quant = f"-{quantization}" if quantization else ""
    quant += f"g{quantization_group_size}" if quantization == "int4" else ""
    return cache_root() / "step-costs" / f"{name}-{weights}-kv{kv}{quant}-{threads}t-{cpu_isa.isa()}.json"


def engine_threads(own_process: bool = True) -> int:
    """The compute threads an engine core gets here by default: `fulcrum serve`'s (own_process) or an in-process
    LLM's (runtime/cpu_threads)."""
    from fulcrum.runtime.cpu_threads import plan

    return plan(None, "auto", own_process).threads


def machine_info() -> dict:
    """The CPU a calibration was measured on: its name, the vector ISA flags that choose kernels, the level forced
    with FULCRUM_CPU_ISA if any, and the cores."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    flags = cpu_isa.cpu_flags()
    info = {"cpu": name, "flags": [f for f in ISA_FLAGS if f in flags], "isa": cpu_isa.isa(), "cores": os.cpu_count()}
    if os.environ.get("FULCRUM_CPU_ISA"):
        info["FULCRUM_CPU_ISA"] = os.environ["FULCRUM_CPU_ISA"]
    return info


# -- from steps to a model -----------------------------------------------------------------------------------


def least_by_shape(steps: list[tuple[StepShape, float]]) -> list[tuple[StepShape, float]]:
    """One (shape, seconds) per distinct shape, in a stable order: the least of its repeats. A step's work is the
    same each time, so what a repeat takes beyond the least is other work on the machine taking its cores."""
    groups: dict[tuple, list[float]] = {}
    shapes: dict[tuple, StepShape] = {}
    for s, t in steps:
        key = astuple(s)
        groups.setdefault(key, []).append(t)
        shapes[key] = s
    return [(shapes[k], min(groups[k])) for k in sorted(groups)]


def robust_fit(steps: list[tuple[StepShape, float]], **meta) -> tuple[StepCosts, int]:
    """`fit`, then once more without the steps it misses by far (over 3x its median miss and over 25%): steps
    slowed in every repeat by other work, which a least-squares fit would otherwise chase. Returns the model and
    how many steps were left out."""
    costs = fit(steps, **meta)
    miss = [abs(costs.step_seconds(s) - t) / t for s, t in steps]
    bar = max(3 * statistics.median(miss), 0.25)
    kept = [st for st, m in zip(steps, miss) if m <= bar]
    if len(kept) == len(steps) or len(kept) < len(steps) // 2:
        return costs, 0
    return fit(kept, **meta), len(steps) - len(kept)


def split_held_out(steps: list[tuple[StepShape, float]]) -> tuple[list, list]:
    """A deterministic split: a shape is held out when a hash of it falls in one fifth (the same shape always
    lands on the same side, whatever else was measured)."""
    fitted, held = [], []
    for s, t in steps:
        digest = hashlib.sha256(repr(astuple(s)).encode()).digest()
        (held if digest[0] % HELD_OUT == 0 else fitted).append((s, t))
    return fitted, held


# -- the frontend and KV transfers ------------------------------------------------------------------------------


def measure_ttft(settings: dict, prompt_tokens: int = 16, requests: int = 20) -> list[float]:
    """TTFT of `requests` sequential streamed completions (max_tokens 2) of a prompt of token ids, against a real
    `fulcrum serve` with the calibrated engine's settings on a free loopback port."""
    flags = ["--dtype", settings["dtype"], "--kv-cache-dtype", settings["kv_cache_dtype"]]
    names = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "quantization")
    names += ("quantization_group_size",) if settings.get("quantization") else ()
    for name in names:
        if settings.get(name) is not None:
            flags += ["--" + name.replace("_", "-"), str(settings[name])]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    rng = random.Random(1)
    out = []
    fd, log = tempfile.mkstemp(prefix="fulcrum-calibrate-serve-", suffix=".log")
    os.close(fd)
    try:
        server = start(settings["model"], *flags, log_path=log, timeout=180)
    except RuntimeError as e:
        raise ValueError(f"{str(e).splitlines()[0]} (its log: {log})") from None
    with server:
        for i in range(requests + 2):  # the first two warm the server up
            body = {"prompt": [rng.randrange(10, 200) for _ in range(prompt_tokens)], "max_tokens": 2,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            req = urllib.request.Request(
                f"{server.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            t0 = time.perf_counter()
            with opener.open(req, timeout=60) as resp:
                first = None
                for line in resp:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
            if i >= 2 and first is not None:
                out.append(first)
    os.unlink(log)
    return out


def kv_transfer_estimate(block_bytes: int) -> tuple[float, dict]:
    """Seconds to move one KV block between two engines on this host: copied out of one cache and into the other
    (two passes at the measured host memcpy rate), plus the per-transfer latency of a loopback round trip (the
    connectors' messages), returned separately."""
    import torch

    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    rate = src.numel() / statistics.median(times[1:])
    a, b = socket.socketpair()
    rtts = []
    with a, b:
        for _ in range(50):
            t0 = time.perf_counter()
            a.sendall(b"x" * 64)
            b.recv(64)
            b.sendall(b"y")
            a.recv(1)
            rtts.append(time.perf_counter() - t0)
    per_block = 2 * block_bytes / rate
    info = {"block_bytes": block_bytes, "memcpy_bytes_per_s": rate, "latency_s": statistics.median(rtts),
            "how": "2 x block bytes / host memcpy rate (out of one cache, into the other); latency_s: a loopback "
                   "round trip, once per transfer"}  # fmt: skip
    return per_block, info


# -- the calibration -------------------------------------------------------------------------------------------


def calibrate(
    model: str | Path | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    quantization: str | None = None,
    quantization_group_size: int = 128,
    quick: bool = False,
    served: bool = True,
    own_process: bool = True,
    say: Callable[[str], None] | None = print,
) -> StepCosts:
    """Measure the engine's steps on this machine and fit a StepCosts (fitted on four fifths of the distinct step
    shapes, its error measured on the rest). `own_process`: the engine's threads as `fulcrum serve` places them
    (False: as an in-process LLM does). `served`: also measure a real server's TTFT for `frontend_s`. ValueError
    with one line for settings the engine refuses.

    `max_num_batched_tokens`: the budget of the replica the costs describe (`engine["served_max_num_batched_tokens"]`,
    what `fulcrum sim` models by default). None: `fulcrum serve`'s own for the device; the sweep then measures prefill
    chunks up to the engine's DEFAULT_MAX_NUM_BATCHED_TOKENS, so the fit covers the larger budgets tune and sim try."""
    from fulcrum.config import EngineConfig, ModelConfig
    from fulcrum.errors import FulcrumError

    say = say or (lambda line: None)
    measured_budget = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    settings = dict(model=str(model or DEFAULT_MODEL), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=measured_budget, block_size=block_size,
                    max_model_len=max_model_len, quantization=quantization,
                    quantization_group_size=quantization_group_size)  # fmt: skip
    try:  # refused here, in one line, before any process starts
        EngineConfig(**settings)
        ModelConfig.from_path(settings["model"], dtype, max_model_len, quantization, quantization_group_size)
    except (FulcrumError, ValueError, OSError) as e:
        raise ValueError(str(e).splitlines()[0]) from None
    sweep = SWEEPS["quick" if quick else "default"]
    t0 = time.perf_counter()
    ttft: list[float] = []
    if served:  # first, while no engine of ours holds the cores
        say("measuring a served request's time to first token (fulcrum serve, 20 streamed requests) ...")
        ttft = measure_ttft({**settings, "max_num_batched_tokens": max_num_batched_tokens})  # None: the server's own
    say(f"measuring the engine's steps ({'quick' if quick else 'default'} sweep) ...")
    got = sweep_in_own_process(settings, sweep, own_process, say)
    engine = got["engine"]
    engine["served_max_num_batched_tokens"] = max_num_batched_tokens or serve_max_num_batched_tokens(
        engine["device"], max_num_seqs
    )
    raw = [(StepShape(**s), t) for s, t in got["steps"]]
    shapes = least_by_shape(raw)
    fitted, held = split_held_out(shapes)
    meta = dict(model=got["engine"]["model"], engine=got["engine"], machine=machine_info())
    costs, dropped = robust_fit(fitted, **meta)
    costs.kv_transfer_s_per_block, transfer = kv_transfer_estimate(got["block_bytes"])
    costs.fit = {
        "steps_measured": len(raw),
        "shapes": len(shapes),
        "shapes_fitted": len(fitted),
        "shapes_held_out": len(held),
        "shapes_left_out_as_outliers": dropped,
        "held_out": errors(costs, held),
        "fitted": errors(costs, fitted),
        "sweep": "quick" if quick else "default",
        "pass_seconds": [round(p, 2) for p in got["pass_seconds"]],
        "seconds": round(time.perf_counter() - t0, 1),
        "kv_transfer": transfer,
    }
    passes = got["pass_seconds"]
    if len(passes) > 1 and max(passes) > 1.3 * min(passes):
        costs.fit["interference"] = (
            f"the sweep's passes took {', '.join(f'{p:.0f}' for p in passes)} s: other work competed for the cores "
            "(each shape keeps its fastest repeat; calibrate on an idle machine for figures to trust)"
        )
        say("warning: " + costs.fit["interference"])
    if ttft:
        prefill = prefill_seconds(costs, 16, engine["served_max_num_batched_tokens"])
        costs.frontend_s = max(statistics.median(ttft) - prefill, 0.0)
        costs.fit["frontend"] = {"ttft_median_s": statistics.median(ttft), "requests": len(ttft),
                                 "prompt_tokens": 16, "predicted_prefill_s": prefill,
                                 "how": "median TTFT of a served 16-token prompt less its predicted prefill step"}  # fmt: skip
    else:
        costs.fit["frontend"] = {"how": "not measured (calibrated without a server): frontend_s is 0"}
    return costs


def local_step_costs(
    model: str | Path | None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    quantization_group_size: int = 128,
    own_process: bool = True,
    served: bool = True,
    say: Callable[[str], None] | None = print,
) -> tuple[StepCosts, Path]:
    """This machine's calibrated step costs for an engine setting: the file at the default path when there is one,
    else a calibration now (saved there). For `fulcrum plan --hardware local` and `--validate`."""
    threads = engine_threads(own_process)
    path = default_costs_path(model, dtype, kv_cache_dtype, threads, quantization, quantization_group_size)
    if path.is_file():
        return StepCosts.load(path), path
    (say or print)(f"no step costs calibrated for this engine here yet ({path}): calibrating (about a minute) ...")
    costs = calibrate(model, dtype, kv_cache_dtype, quantization=quantization,
                      quantization_group_size=quantization_group_size, own_process=own_process, served=served,
                      say=say)  # fmt: skip
    return costs, costs.save(path)
