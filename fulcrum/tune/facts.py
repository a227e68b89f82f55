"""What tune knows before it measures: the machine (cores or GPUs, memory), the model's shape and plan's memory
arithmetic (what cannot fit is pruned unstarted), the workload's lengths, and, for an SLO nothing here meets, the
hardware plan's roofline says would."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from fulcrum.bench.workloads import TextMaker, WorkloadSpec, sessions
from fulcrum.defaults import DEFAULT_CPU_KV_BYTES, ONLINE_QUANTIZATIONS
from fulcrum.plan.catalog import Hardware, load_catalog
from fulcrum.plan.memory import plan_memory
from fulcrum.plan.model_spec import DTYPE_BYTES, ModelSpec, kv_bytes_per_sequence, parameter_counts
from fulcrum.plan.roofline import decode_step, prefill
from fulcrum.tune.space import Config
from fulcrum.tune.target import Bound

OPENING_CHARS = 200  # sessions whose first this many characters repeat share a prefix a cache can serve
# assumed prices when --price-per-hour is not given (typical on-demand cloud rates, late 2026)
ASSUMED_PRICE = {"cpu": 0.05, "cuda": 3.0}  # dollars per core-hour / per GPU-hour
RUNTIME_RESERVE = 0.85  # share of free memory the candidates' weights and KV may take


@dataclass
class Facts:
    """What the walk knows before it measures: the machine, the model, the workload, and plan's arithmetic."""

    device: str = "cpu"  # cpu or cuda
    units: int = 1  # CPU cores or GPUs the candidates may use
    num_heads: int = 1
    num_kv_heads: int = 1
    num_layers: int = 1
    shares_prefixes: bool = False
    mean_input_len: float = 0.0
    mean_output_len: float = 0.0
    kv_cache_need_gib: float | None = None  # KV of the ladder's top concurrency at the workload's lengths
    kv_cache_default_gib: float | None = None  # what the engine takes by default (CPU: 2 GiB)
    fits: Callable[[Config], str | None] = lambda c: None  # why a config cannot fit (plan's memory), or None
    draft: str | None = None  # a draft model folder for speculative decoding
    quantizations: tuple[str, ...] = ONLINE_QUANTIZATIONS
    kv_cache_dtypes: tuple[str, ...] = ("int8", "fp8")  # KV_CACHE_DTYPES less auto and fp8's other name
    exposes: Callable[[str], bool] = lambda knob: True  # whether the server command takes the knob
    # fulcrum's own server, whose defaults the walk knows; False for another engine's (`--serve-cmd`), whose
    # baseline runs at its own defaults
    fulcrum_server: bool = True
    pd_possible: str | None = None  # why P/D cannot be measured here (None: it can)
    target_rate: float | None = None
    price_per_hour: float | None = None
    router_policy: str = "least-load"


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


@dataclass(frozen=True)
class WorkloadFacts:
    mean_input_len: float
    max_input_len: float
    mean_output_len: float
    max_output_len: float
    turns: int  # the most requests one session sends (a conversation's turns)
    shares_prefixes: bool


def workload_facts(spec: WorkloadSpec, text: TextMaker, n: int = 64) -> WorkloadFacts:
    """Prompt and output lengths of the workload's first `n` sessions (a conversation's turns carry its history:
    each turn's prompt counts what came before), and whether their prompts share prefixes a cache can serve: a
    conversation's later turns do, and so do sessions whose opening text (system prompt and first turn) repeats."""
    prompts, outputs, turns, openings = [], [], 1, []
    for s in islice(sessions(spec, text), n):
        history = s.system_len
        for new, out in zip(s.input_lens, s.max_tokens):
            history += new
            prompts.append(history)
            outputs.append(out)
            history += out
        turns = max(turns, len(s.user_turns))
        openings.append(((s.system or "") + (s.user_turns[0] if s.user_turns else ""))[:OPENING_CHARS])
    if not prompts:
        raise ValueError("the workload has no requests")
    repeated = len(openings) - len(set(openings))
    return WorkloadFacts(sum(prompts) / len(prompts), max(prompts), sum(outputs) / len(outputs), max(outputs), turns,
                         turns > 1 or repeated >= len(openings) / 4)  # fmt: skip


class MemoryCheck:
    """Plan's arithmetic on a candidate before it starts. On CPU, every engine's weights (in the candidate's format)
    and KV cache against the host's free memory; on GPUs, plan's memory plan at the candidate's TP x PP: the weights
    and one sequence must fit (the engine gives the KV cache what memory is left)."""

    def __init__(self, spec: ModelSpec, machine: Machine, seq_len: int, concurrency: int):
        self.spec, self.machine, self.seq_len, self.concurrency = spec, machine, seq_len, concurrency
        self.params = parameter_counts(spec).total

    def kv_gib(self, kv_dtype: str = "bf16") -> float:
        """The KV cache `concurrency` sequences of `seq_len` tokens take."""
        return self.concurrency * kv_bytes_per_sequence(self.spec, self.seq_len, kv_dtype) / 2**30

    def __call__(self, c: Config) -> str | None:
        weight_dtype = c.get("quantization") or self.spec.dtype
        kv_dtype = {"auto": self.spec.dtype, "fp8_e4m3": "fp8"}.get(c.get("kv_cache_dtype"), c.get("kv_cache_dtype"))
        tp, pp = c.get("tensor_parallel_size"), c.get("pipeline_parallel_size")
        engines = c.get("data_parallel_size") * c.engines()
        unit = "GPUs" if self.machine.device == "cuda" else "cores"
        if tp * pp * engines > self.machine.units:
            return f"{tp * pp * engines} ranks on {self.machine.units} {unit}"
        if self.machine.device == "cuda":
            hw = Hardware(self.machine.name, self.machine.memory_bytes, 1.0, {})
            plan = plan_memory(self.spec, hw, weight_dtype, kv_dtype, self.seq_len, 1, tp, pp)
            if plan.max_concurrency < 1:
                return f"weights and one sequence of {self.seq_len} tokens do not fit {tp * pp} GPU(s)"
            return None
        weights = self.params * DTYPE_BYTES.get(weight_dtype, 2.0)
        kv = c.get("kv_cache_memory") * 2**30 if c.get("kv_cache_memory") else DEFAULT_CPU_KV_BYTES
        need, have = engines * (weights + kv), self.machine.memory_bytes * RUNTIME_RESERVE
        if need > have:
            return f"{need / 2**30:.1f} GiB of weights and KV cache, {have / 2**30:.1f} GiB free"
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
