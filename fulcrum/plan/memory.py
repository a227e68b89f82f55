"""The memory calculator: weights, KV cache, activations and runtime reserve per GPU; whether it fits,
how many sequences fit, and the fewest GPUs (and the TP x PP split) that hold the model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulcrum.plan.catalog import Hardware
from fulcrum.plan.model_spec import (
    ModelSpec,
    ParamCount,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    parameter_counts,
    routed_expert_matrix_params,
    weight_bytes,
)

GPUS_PER_NODE = 8  # tensor parallelism stays inside one node's NVLink domain; beyond, pipeline stages


@dataclass(frozen=True)
class MemoryAssumptions:
    # vLLM's default gpu_memory_utilization: the last 10% of the card is left to the CUDA context, cuBLAS and NCCL
    # workspaces, CUDA graphs and fragmentation
    memory_utilization: float = 0.90
    # activations peak in the largest prefill chunk (vLLM's max_num_batched_tokens for serving on large GPUs)
    prefill_chunk_tokens: int = 8192
    logit_rows: int = 256  # sequences sampled in one step; logits are kept in fp32
    activation_bytes: float = 2.0  # activations in 16-bit

    def describe(self) -> list[str]:
        return [
            f"{100 * (1 - self.memory_utilization):.0f}% of each GPU reserved for CUDA context, workspaces, "
            "CUDA graphs and fragmentation (vLLM's default gpu_memory_utilization=0.9)",
            f"activation peak: one {self.prefill_chunk_tokens}-token prefill chunk in 16-bit plus fp32 logits "
            f"for {self.logit_rows} sequences",
            "weights: every parameter at --weight-dtype (quantization scales, about 1-3%, not counted)",
        ]


@dataclass(frozen=True)
class MemoryPlan:
    weight_dtype: str
    kv_dtype: str
    context: int
    concurrency: int
    tp: int
    pp: int
    params: ParamCount
    weight_bytes: float
    active_weight_bytes: float
    kv_per_token: float  # bytes, all layers, one token (before any sliding window is full)
    kv_per_sequence: float  # one sequence of `context` tokens
    kv_total: float  # `concurrency` sequences
    capacity: float  # bytes per GPU
    usable: float  # capacity less the runtime reserve
    weights_per_gpu: float
    kv_per_gpu: float
    activations_per_gpu: float
    max_concurrency: int  # sequences of `context` tokens that fit beside the weights, at this TP x PP
    min_gpus: int  # fewest GPUs that hold weights, activations and one sequence (0: more than 64)
    suggested_tp: int
    suggested_pp: int

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def weights_fit(self) -> bool:
        return self.weights_per_gpu + self.activations_per_gpu < self.usable

    @property
    def fits(self) -> bool:
        return self.weights_per_gpu + self.kv_per_gpu + self.activations_per_gpu <= self.usable


def kv_shards(spec: ModelSpec, tp: int, pp: int) -> int:
    """Over how many GPUs one sequence's KV cache spreads: pipeline stages split the layers; tensor parallelism
    splits KV heads, but only as far as there are heads (more ranks replicate them) and not at all for MLA,
    whose one latent per token every rank keeps."""
    return pp * (1 if spec.mla else min(tp, spec.num_kv_heads))


def activation_bytes(spec: ModelSpec, tp: int, a: MemoryAssumptions) -> float:
    """The largest prefill chunk's live tensors on one GPU: residual and normed hidden, q/k/v, the MLP's
    gate-up output and its activation (sharded by TP), and the fp32 logits of one step's samples."""
    inter = spec.intermediate
    if spec.moe:
        inter = spec.moe.experts_per_token * spec.moe.expert_intermediate + spec.moe.shared_intermediate
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_token = 2 * spec.hidden + (qkv + 3 * inter) / tp
    return a.prefill_chunk_tokens * per_token * a.activation_bytes + a.logit_rows * spec.vocab / tp * 4


def split_for(spec: ModelSpec, n: int) -> tuple[int, int]:
    """TP within a node (a power of two that divides the attention heads), PP for the rest."""
    tp = min(n, GPUS_PER_NODE)
    while tp > 1 and spec.num_heads % tp:
        tp //= 2
    return tp, math.ceil(n / tp)


def plan_memory(
    spec: ModelSpec,
    hw: Hardware,
    weight_dtype: str,
    kv_dtype: str,
    context: int,
    concurrency: int,
    tp: int = 1,
    pp: int = 1,
    a: MemoryAssumptions = MemoryAssumptions(),  # noqa: B008 (frozen)
) -> MemoryPlan:
    params = parameter_counts(spec)
    weights = weight_bytes(spec, params.total, weight_dtype, routed_expert_matrix_params(spec))
    kv_seq = kv_bytes_per_sequence(spec, context, kv_dtype)
    usable = hw.memory_bytes * a.memory_utilization

    def per_gpu(t: int, p: int, seqs: int) -> tuple[float, float, float]:
        return weights / (t * p), seqs * kv_seq / kv_shards(spec, t, p), activation_bytes(spec, t, a)

    w_gpu, kv_gpu, act_gpu = per_gpu(tp, pp, concurrency)
    room = usable - w_gpu - act_gpu
    max_conc = max(0, int(room // (kv_seq / kv_shards(spec, tp, pp)))) if kv_seq else 0

    min_gpus, best = 0, (1, 1)
    for n in (1, 2, 4, 8, 16, 32, 64):
        t, p = split_for(spec, n)
        if sum(per_gpu(t, p, 1)) <= usable:
            min_gpus, best = t * p, (t, p)
            break
    return MemoryPlan(
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        context=context,
        concurrency=concurrency,
        tp=tp,
        pp=pp,
        params=params,
        weight_bytes=weights,
        active_weight_bytes=weight_bytes(
            spec,
            params.active,
            weight_dtype,
            routed_expert_matrix_params(spec, spec.moe and spec.moe.experts_per_token),
        ),
        kv_per_token=kv_bytes_per_token(spec, kv_dtype),
        kv_per_sequence=kv_seq,
        kv_total=kv_seq * concurrency,
        capacity=hw.memory_bytes,
        usable=usable,
        weights_per_gpu=w_gpu,
        kv_per_gpu=kv_gpu,
        activations_per_gpu=act_gpu,
        max_concurrency=max_conc,
        min_gpus=min_gpus,
        suggested_tp=best[0],
        suggested_pp=best[1],
    )
