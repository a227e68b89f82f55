"""`--hardware local`: this machine as a catalog entry, from what `fulcrum.probe` measured at the model's own
shapes. plan measures nothing itself: the CLI runs the probe and hands plan the numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.plan.catalog import Hardware
from fulcrum.plan.roofline import Efficiency

# The local figures are measured at the workload's own shapes with the engine's kernels, so they already are
# what the kernels reach: no further efficiency factor. (One machine: no all-reduce.)
LOCAL_EFFICIENCY = Efficiency(bandwidth=1.0, compute=1.0, allreduce_latency_s=0.0)


@dataclass(frozen=True)
class LocalMeasurements:
    """This machine measured at a model's shapes, in the dtype the model runs in (`fulcrum.probe.machine`)."""

    dtype: str
    threads: int
    memory_bytes: float
    bandwidth_by_batch: dict[int, float]  # bytes/s of weights streamed by GEMVs of that many rows; has batch 1
    matmul_flops: float  # FLOP/s of a prefill's MLP matmul
    attention_flops: float | None  # FLOP/s of a prompt's causal attention (None: not measured, MLA)
    layer_overhead_s: float  # a decoder layer's cost in a batch-1 decode step beyond its weight reads
    op_latency_s: float  # per framework op of that layer
    notes: list[str] = field(default_factory=list)  # how each figure was measured, in words


def local_hardware(m: LocalMeasurements) -> Hardware:
    """The catalog entry for this machine (CPUs have no fp8/fp4 matmuls: the model's own dtype, and bf16)."""
    return Hardware(
        name="local",
        memory_bytes=m.memory_bytes,
        bandwidth=m.bandwidth_by_batch[1],
        flops={m.dtype: m.matmul_flops, "bf16": m.matmul_flops},
        interconnect="none",
        formats=(m.dtype,),
        source=f"measured on this machine, {m.threads} threads",
        op_latency_s=m.op_latency_s,
        layer_overhead_s=m.layer_overhead_s,
        bandwidth_by_batch=dict(m.bandwidth_by_batch),
        attention_flops=m.attention_flops,
        notes=list(m.notes),
    )
