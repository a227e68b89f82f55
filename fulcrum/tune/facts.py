"""What tune knows before it measures: the machine (cores or GPUs, memory), the model's shape and plan's memory
arithmetic (what cannot fit is pruned unstarted), the workload's lengths, and, for an SLO nothing here meets, the
hardware plan's roofline says would."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from fulcrum.bench.workloads import TextMaker, WorkloadSpec, sessions
from fulcrum.plan.catalog import load_catalog
from fulcrum.plan.model_spec import DTYPE_BYTES, ModelSpec, kv_bytes_per_sequence, parameter_counts
from fulcrum.plan.roofline import decode_step, prefill
from fulcrum.tune.space import Config
from fulcrum.tune.target import Bound

CPU_DEFAULT_KV_GIB = 2.0  # the engine's KV cache on CPU when --kv-cache-memory is not given
# assumed prices when --price-per-hour is not given (typical on-demand cloud rates, late 2026)
ASSUMED_PRICE = {"cpu": 0.05, "cuda": 3.0}  # dollars per core-hour / per GPU-hour
RUNTIME_RESERVE = 0.85  # share of free memory the candidates' weights and KV may take


@dataclass
class Machine:
    device: str  # cpu or cuda
    units: int  # cores or GPUs
    memory_bytes: float  # free host memory (CPU) or memory per GPU
    name: str

    def describe(self) -> str:
        unit = "GPU" if self.device == "cuda" else "core"
        return f"{self.name}: {self.units} {unit}{'s' * (self.units > 1)}, {self.memory_bytes / 2**30:.1f} GiB " + (
            "per GPU" if self.device == "cuda" else "free"
        )


def _gpus() -> list[tuple[str, float]]:
    """(name, memory bytes) of each NVIDIA GPU, from nvidia-smi; none when it is absent."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, _, mib = line.rpartition(",")
        gpus.append((name.strip(), float(mib) * 2**20))
    return gpus


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU"
    m = re.search(r"model name\s*:\s*(.+)", text)
    return m.group(1).strip() if m else "CPU"


def free_memory() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def this_machine(count: int | None = None, device: str | None = None) -> Machine:
    gpus = _gpus() if device != "cpu" else []
    if gpus:
        n = min(count or len(gpus), len(gpus))
        return Machine("cuda", n, gpus[0][1], gpus[0][0])
    cores = len(os.sched_getaffinity(0))
    return Machine("cpu", min(count or cores, cores), free_memory(), _cpu_name())


def workload_lengths(spec: WorkloadSpec, text: TextMaker, n: int = 64) -> tuple[float, float, float, float]:
    """Mean and largest prompt and output tokens of the workload's first `n` requests (a conversation's turns
    carry its history: each turn's prompt counts what came before)."""
    prompts, outputs = [], []
    for s in islice(sessions(spec, text), n):
        history = s.system_len
        for new, out in zip(s.input_lens, s.max_tokens):
            history += new
            prompts.append(history)
            outputs.append(out)
            history += out
    if not prompts:
        raise ValueError("the workload has no requests")
    return sum(prompts) / len(prompts), max(prompts), sum(outputs) / len(outputs), max(outputs)


class MemoryCheck:
    """Plan's arithmetic on a candidate: its weights (in the candidate's format, once per data-parallel rank,
    split over tensor and pipeline ranks) and KV cache against the machine's memory."""

    def __init__(self, spec: ModelSpec, machine: Machine, seq_len: int, concurrency: int):
        self.spec, self.machine, self.seq_len, self.concurrency = spec, machine, seq_len, concurrency
        self.params = parameter_counts(spec).total

    def kv_gib(self, kv_dtype: str = "bf16") -> float:
        return self.concurrency * kv_bytes_per_sequence(self.spec, self.seq_len, kv_dtype) / 2**30

    def __call__(self, c: Config) -> str | None:
        weight_dtype = c.get("quantization") or self.spec.dtype
        weights = self.params * DTYPE_BYTES.get(weight_dtype, 2.0)
        kv_dtype = {"auto": self.spec.dtype, "fp8_e4m3": "fp8"}.get(c.get("kv_cache_dtype"), c.get("kv_cache_dtype"))
        if self.machine.device == "cpu":
            kv = (c.get("kv_cache_memory") or CPU_DEFAULT_KV_GIB) * 2**30
        else:
            kv = self.kv_gib(kv_dtype) * 2**30
        split = c.get("tensor_parallel_size") * c.get("pipeline_parallel_size")
        engines = c.get("data_parallel_size") * c.engines()
        if self.machine.device == "cpu":  # one host memory for every rank
            need, have = engines * (weights + kv), self.machine.memory_bytes * RUNTIME_RESERVE
        else:  # each GPU holds its share
            need, have = (weights / split + kv / split), self.machine.memory_bytes * RUNTIME_RESERVE
        units = split * engines
        if units > self.machine.units:
            return f"{units} ranks on {self.machine.units} {'GPUs' if self.machine.device == 'cuda' else 'cores'}"
        if need > have:
            return f"{need / 2**30:.1f} GiB of weights and KV cache, {have / 2**30:.1f} GiB usable"
        return None


def hardware_that_meets(spec: ModelSpec, slo: list[Bound], prompt_len: int, context: int) -> list[str]:
    """Catalog hardware whose roofline (plan's arithmetic, one GPU, batch 1) meets the TTFT and TPOT bounds: what
    an SLO this machine cannot reach would need."""
    ttft = min((b.seconds for b in slo if b.metric in ("ttft", "e2e")), default=None)
    tpot = min((b.seconds for b in slo if b.metric in ("tpot", "itl")), default=None)
    out = []
    for name, hw in load_catalog().items():
        if hw.memory_bytes * 0.9 < parameter_counts(spec).total * DTYPE_BYTES.get(spec.dtype, 2.0):
            continue
        ok_ttft = ttft is None or prefill(spec, hw, spec.dtype, max(prompt_len, 1)).seconds <= ttft
        ok_tpot = tpot is None or decode_step(spec, hw, spec.dtype, spec.dtype, 1, context).tpot_s <= tpot
        if ok_ttft and ok_tpot:
            out.append(name)
    return out
