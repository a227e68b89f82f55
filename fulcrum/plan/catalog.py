"""The hardware catalog: accelerators' memory, bandwidth and FLOPS, read from hardware.json (data, with sources)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.errors import UnknownHardwareError

CATALOG = Path(__file__).with_name("hardware.json")


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s
    flops: dict[str, float]  # dense FLOP/s by compute format
    interconnect: str = ""
    interconnect_bandwidth: float = 0.0  # bytes/s
    formats: tuple[str, ...] = ()
    source: str = ""
    # fixed time per engine step that no bandwidth or FLOPS explains (kernel launches, Python); GPUs running
    # CUDA graphs are taken as 0, the local CPU measures it
    step_overhead_s: float = 0.0
    op_latency_s: float = 0.0  # per framework op, where it was measured (local)
    layer_overhead_s: float = 0.0  # framework cost of one decoder layer beyond its weight reads (local)
    # measured weight-streaming rate by batch rows, where it depends on them (a CPU's GEMV does more arithmetic per
    # byte as rows grow, and the engine switches kernels); batches not listed stream at `bandwidth`
    bandwidth_by_batch: dict[int, float] = field(default_factory=dict)
    # FLOP/s of a prompt's causal attention where measured (local: on CPU it runs far below the matmul rate, its
    # softmax and masking being memory-bound); elsewhere attention is taken at the matmul peak
    attention_flops: float | None = None
    notes: list[str] = field(default_factory=list)

    def compute_format(self, weight_dtype: str) -> str:
        """The format matmuls run in: the weights' own low-precision format where the tensor cores have it
        (fp8 on Hopper, fp4 on Blackwell); otherwise weight-only quantization, dequantized to 16-bit."""
        if weight_dtype in ("fp8", "fp4", "fp32") and weight_dtype in self.flops:
            return weight_dtype
        return "fp16" if weight_dtype == "fp16" and "fp16" in self.flops else "bf16"

    def stream_bandwidth(self, batch: int) -> float:
        return self.bandwidth_by_batch.get(batch, self.bandwidth)

    def peak_flops(self, weight_dtype: str) -> float:
        return self.flops[self.compute_format(weight_dtype)]

    def attention_rate(self, weight_dtype: str) -> float:
        return self.attention_flops or self.peak_flops(weight_dtype)


def load_catalog(path: Path = CATALOG) -> dict[str, Hardware]:
    data = json.loads(path.read_text())["gpus"]
    return {
        name: Hardware(
            name=name,
            memory_bytes=e["memory_gb"] * 1e9,
            bandwidth=e["bandwidth_gbs"] * 1e9,
            flops={k: v * 1e12 for k, v in e["tflops"].items()},
            interconnect=e["interconnect"],
            interconnect_bandwidth=e["interconnect_gbs"] * 1e9,
            formats=tuple(e["formats"]),
            source=e["source"],
        )
        for name, e in data.items()
    }


def get_hardware(name: str, catalog: dict[str, Hardware] | None = None) -> Hardware:
    """Look a name up case-insensitively, ignoring '-', '_' and spaces ('h100 sxm' finds H100-SXM)."""
    catalog = catalog or load_catalog()

    def key(s: str) -> str:
        return s.lower().replace("-", "").replace("_", "").replace(" ", "")

    for hw_name, hw in catalog.items():
        if key(hw_name) == key(name):
            return hw
    raise UnknownHardwareError(f"unknown hardware {name!r}; known: {', '.join(catalog)}, local (this machine)")
