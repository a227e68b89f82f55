"""Roofline estimates: prefill is bound by compute, a decode step by reading weights and KV cache until the batch
is large enough to be compute-bound; efficiency factors say how much of the peak real kernels reach."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulcrum.plan.catalog import Hardware
from fulcrum.plan.memory import kv_shards
from fulcrum.plan.model_spec import DTYPE_BYTES, ModelSpec, kv_bytes_per_sequence, parameter_counts
from fulcrum.utils.cost import cost_per_million_tokens

# Framework ops of one fulcrum decode step outside its decoder layers (embedding, rotary lookup, the decode mask,
# final norm, logits, sampler, input tensors), counted with torch.profiler on the bundled Llama and the
# Qwen2.5-0.5B shape; priced at the measured op latency where there is one (the local CPU). The layers themselves
# are priced whole, by timing a stack of them (`local.measure_framework_cost`).
OPS_PER_STEP = 60


@dataclass(frozen=True)
class Efficiency:
    bandwidth: float = 0.80  # decode GEMV and attention kernels reach about 70-85% of peak HBM bandwidth
    compute: float = 0.60  # prefill GEMMs and attention together, as a share of dense peak FLOPS (MFU)
    allreduce_latency_s: float = 10e-6  # one small all-reduce over NVLink; tensor parallelism does two per layer

    def describe(self) -> list[str]:
        return [
            f"bandwidth efficiency {self.bandwidth:.0%} of peak (decode reads), compute efficiency "
            f"{self.compute:.0%} of dense peak (prefill)",
            f"tensor parallel: 2 all-reduces per layer, {self.allreduce_latency_s * 1e6:.0f} us each plus "
            "ring transfer at the interconnect bandwidth",
            "MoE: tokens route uniformly, so a batch of B reads E * (1 - (1 - k/E)^B) experts per layer",
        ]


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int  # KV length each sequence attends over
    tpot_s: float
    tokens_per_s: float
    bound: str  # memory or compute
    bytes_per_step: float
    flops_per_step: float
    overhead_s: float
    cost_per_million: float | None = None


@dataclass(frozen=True)
class Prefill:
    tokens: int
    seconds: float
    tokens_per_s: float
    bound: str
    flops: float


def step_overhead(spec: ModelSpec, hw: Hardware) -> float:
    return hw.step_overhead_s + spec.num_layers * hw.layer_overhead_s + OPS_PER_STEP * hw.op_latency_s


def weight_bytes_read(spec: ModelSpec, weight_dtype: str, batch: int) -> float:
    """Bytes of weights one decode step streams: all but the embedding table (a lookup reads only rows; a tied
    table is read whole as the LM head), and for MoE only the experts some token of the batch routes to."""
    p = parameter_counts(spec)
    params = p.total - (p.embedding if p.lm_head else 0)
    if spec.moe:
        m = spec.moe
        expert = (p.total - p.active) / (m.num_experts - m.experts_per_token) / (spec.num_layers - m.dense_layers)
        unread = m.num_experts * (1 - m.experts_per_token / m.num_experts) ** batch
        params -= unread * expert * (spec.num_layers - m.dense_layers)
    return params * DTYPE_BYTES[weight_dtype]


def matmul_params(spec: ModelSpec) -> float:
    """Parameters a token multiplies with (active, less the embedding lookup)."""
    p = parameter_counts(spec)
    return p.active - p.embedding + (0 if p.lm_head else p.embedding)


def attention_flops(spec: ModelSpec, query_tokens: int, context: int, causal: bool) -> float:
    """QK^T and PV for `query_tokens` over `context` keys (half of them when causal), in every layer."""
    if spec.mla:  # absorbed MLA attends in the latent space: the latent plus the RoPE key per head
        width = spec.num_heads * (2 * spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)
    else:
        width = spec.num_heads * spec.head_dim * 2
    total = 0.0
    for w in spec.windows:
        keys = min(context, w or context)
        total += 2 * query_tokens * width * (keys / 2 if causal and not w else keys)
    return total


def _comm(spec: ModelSpec, hw: Hardware, tokens: int, tp: int, eff: Efficiency) -> float:
    if tp == 1:
        return 0.0
    ring = 2 * (tp - 1) / tp * tokens * spec.hidden * 2 / max(hw.interconnect_bandwidth, 1.0)
    return 2 * spec.num_layers * (eff.allreduce_latency_s + ring)


def decode_step(
    spec: ModelSpec,
    hw: Hardware,
    weight_dtype: str,
    kv_dtype: str,
    batch: int,
    context: int,
    tp: int = 1,
    pp: int = 1,
    eff: Efficiency = Efficiency(),  # noqa: B008 (frozen)
    price_per_hour: float | None = None,
) -> DecodePoint:
    """One step that decodes a token for each of `batch` sequences. Pipeline stages run one after another for a
    token, so the step spans all layers on `tp` GPUs' bandwidth."""
    replicas = tp * pp / kv_shards(spec, tp, pp)  # TP ranks beyond the KV heads (or any, for MLA) read copies
    kv = batch * kv_bytes_per_sequence(spec, context, kv_dtype) * replicas
    nbytes = weight_bytes_read(spec, weight_dtype, batch) + kv
    flops = 2 * matmul_params(spec) * batch + attention_flops(spec, batch, context, causal=False)
    t_mem = nbytes / (tp * hw.stream_bandwidth(batch) * eff.bandwidth)
    t_compute = flops / (tp * hw.peak_flops(weight_dtype) * eff.compute)
    overhead = step_overhead(spec, hw) + _comm(spec, hw, batch, tp, eff)
    tpot = max(t_mem, t_compute) + overhead
    tps = batch / tpot
    cost = cost_per_million_tokens(price_per_hour, tps, replicas=tp * pp) if price_per_hour else None
    return DecodePoint(
        batch=batch,
        context=context,
        tpot_s=tpot,
        tokens_per_s=tps,
        bound="memory" if t_mem >= t_compute else "compute",
        bytes_per_step=nbytes,
        flops_per_step=flops,
        overhead_s=overhead,
        cost_per_million=cost,
    )


def prefill(
    spec: ModelSpec,
    hw: Hardware,
    weight_dtype: str,
    tokens: int,
    tp: int = 1,
    pp: int = 1,
    eff: Efficiency = Efficiency(),  # noqa: B008 (frozen)
    chunk_tokens: int = 8192,
) -> Prefill:
    """One prompt's prefill: its matmuls and causal attention against peak FLOPS, never faster than reading the
    weights once per chunk; logits only for the last token."""
    head = 2 * spec.vocab * spec.hidden
    matmul = (2 * matmul_params(spec) - head) * tokens + head
    attention = attention_flops(spec, tokens, tokens, causal=True)
    flops = matmul + attention
    steps = math.ceil(tokens / chunk_tokens)
    rate = tp * eff.compute
    t_compute = matmul / (rate * hw.peak_flops(weight_dtype)) + attention / (rate * hw.attention_rate(weight_dtype))
    t_mem = steps * weight_bytes_read(spec, weight_dtype, tokens) / (tp * hw.bandwidth * eff.bandwidth)
    seconds = max(t_compute, t_mem) + steps * (step_overhead(spec, hw) + _comm(spec, hw, tokens, tp, eff))
    return Prefill(tokens, seconds, tokens / seconds, "compute" if t_compute >= t_mem else "memory", flops)


def batch_sizes(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (and `limit` itself)."""
    out = [1]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out + ([limit] if limit > out[-1] else [])
