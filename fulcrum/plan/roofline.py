"""Roofline estimates: prefill is bound by compute, a decode step by reading weights and KV cache until the batch
is large enough to be compute-bound; efficiency factors say how much of the peak real kernels reach."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulcrum.errors import ModelLoadError
from fulcrum.plan.catalog import Hardware
from fulcrum.plan.memory import kv_shards
from fulcrum.plan.model_spec import (
    DTYPE_BYTES,
    ModelSpec,
    kv_bytes_per_sequence,
    parameter_counts,
    routed_expert_matrix_params,
    weight_bytes,
)
from fulcrum.utils.cost import cost_per_million_tokens

# Framework ops of one fulcrum decode step outside its decoder layers (embedding, rotary lookup, the decode mask,
# final norm, logits, sampler, input tensors), counted with torch.profiler on the bundled Llama and the
# Qwen2.5-0.5B shape; priced at the measured op latency where there is one (the local CPU). The layers themselves
# are priced whole, by timing a stack of them (`local.measure_framework_cost`).
OPS_PER_STEP = 60

# fulcrum's online weight quantization (`--quantization`, fulcrum/quant/online.py) and int4's group sizes, as the
# engine spells them (fulcrum.config's ONLINE_QUANTIZATIONS and INT4_GROUP_SIZES; plan cannot import config, which
# imports torch, so tests/plan hold the two equal)
QUANT_METHODS = ("int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)
SCALE_BYTES = 4  # the quantized weights' scales and offsets are fp32


@dataclass(frozen=True)
class OnlineQuant:
    """Weights as fulcrum's online quantization stores them: every linear layer and the LM head quantized; norms,
    biases and an untied embedding table kept in the model's dtype (a tied table is the quantized head's)."""

    method: str  # one of QUANT_METHODS
    group_size: int = 128  # int4's

    def matrix_bytes(self, out: int, inp: int) -> float:
        """An [out, in] weight: int8/fp8 one byte a weight and a scale per output channel; int4 half a byte and a
        scale and an offset per group of `group_size` inputs."""
        if self.method == "int4":
            return out * inp / 2 + 2 * SCALE_BYTES * out * (inp // self.group_size)
        return out * inp + SCALE_BYTES * out

    @property
    def name(self) -> str:
        """As the engine's startup log names it: "int8", "int4 (group 128)"."""
        return f"int4 (group {self.group_size})" if self.method == "int4" else self.method

    def describe(self) -> str:
        if self.method == "int4":
            g = self.group_size
            return f"int4 (group {g}): half a byte per weight + an fp32 scale and offset per {g} inputs"
        return f"{self.method}: one byte per weight + an fp32 scale per output channel"

    def check(self, spec: ModelSpec) -> None:
        """The engine's own refusals, before anything is measured: int4 groups must divide every layer's inputs."""
        if spec.moe or spec.mla:
            raise ModelLoadError(f"{spec.name}: plan predicts online quantization for dense models only (no MoE/MLA)")
        if self.method == "int4":
            if self.group_size not in INT4_GROUP_SIZES:
                raise ModelLoadError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
            inputs = sorted({i for _, i in linear_matrices(spec)})
            bad = [i for i in inputs if i % self.group_size]
            if bad:
                fits = ", ".join(str(g) for g in INT4_GROUP_SIZES if all(i % g == 0 for i in inputs)) or "none"
                raise ModelLoadError(
                    f"int4 with group size {self.group_size} needs every linear layer's input features divisible by "
                    f"it; {spec.name} has {', '.join(map(str, bad))} (group sizes that fit: {fits})"
                )


def layer_matrices(spec: ModelSpec) -> list[tuple[int, int]]:
    """A dense decoder layer's weight matrices, (out, in), in the order decode reads them: q/k/v, o, gate/up, down."""
    h, hd = spec.hidden, spec.head_dim
    return [
        ((spec.num_heads + 2 * spec.num_kv_heads) * hd, h),
        (h, spec.num_heads * hd),
        (2 * spec.intermediate, h),
        (h, spec.intermediate),
    ]


def linear_matrices(spec: ModelSpec) -> list[tuple[int, int]]:
    """Every linear weight of a dense model, (out, in): its layers' and the LM head (tied or not)."""
    return layer_matrices(spec) * spec.num_layers + [(spec.vocab, spec.hidden)]


def resident_weight_bytes(spec: ModelSpec, weight_dtype: str, quant: OnlineQuant | None = None) -> float:
    """Bytes the weights take in memory: every parameter at `weight_dtype`, or with `quant` the linear layers and
    the LM head in its format and the rest (norms, biases, an untied embedding) at `weight_dtype`."""
    total = parameter_counts(spec).total
    if quant is None:
        return weight_bytes(spec, total, weight_dtype, routed_expert_matrix_params(spec))
    matrices = linear_matrices(spec)
    rest = total - sum(o * i for o, i in matrices)  # a tied embedding is the head's table: not counted twice
    return rest * DTYPE_BYTES[weight_dtype] + sum(quant.matrix_bytes(o, i) for o, i in matrices)


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


def weight_bytes_read(spec: ModelSpec, weight_dtype: str, batch: int, quant: OnlineQuant | None = None) -> float:
    """Bytes of weights one decode step streams: all but the embedding table (a lookup reads only rows; a tied
    table is read whole as the LM head), and for MoE only the experts some token of the batch routes to. With
    `quant` (dense models), the weights as `resident_weight_bytes` counts them."""
    p = parameter_counts(spec)
    if quant is not None:
        return resident_weight_bytes(spec, weight_dtype, quant) - (
            p.embedding * DTYPE_BYTES[weight_dtype] if p.lm_head else 0
        )
    params = p.total - (p.embedding if p.lm_head else 0)
    read = None
    if spec.moe:
        m = spec.moe
        expert = (p.total - p.active) / (m.num_experts - m.experts_per_token) / (spec.num_layers - m.dense_layers)
        unread = m.num_experts * (1 - m.experts_per_token / m.num_experts) ** batch
        params -= unread * expert * (spec.num_layers - m.dense_layers)
        read = m.num_experts - unread
    return weight_bytes(spec, params, weight_dtype, routed_expert_matrix_params(spec, read) if read else 0)


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
    quant: OnlineQuant | None = None,
) -> DecodePoint:
    """One step that decodes a token for each of `batch` sequences. Pipeline stages run one after another for a
    token, so the step spans all layers on `tp` GPUs' bandwidth. With `quant`, `weight_dtype` is what the weights
    compute in (the model's dtype: fulcrum's online formats are weight-only) and `quant` what they are stored in."""
    replicas = tp * pp / kv_shards(spec, tp, pp)  # TP ranks beyond the KV heads (or any, for MLA) read copies
    kv = batch * kv_bytes_per_sequence(spec, context, kv_dtype) * replicas
    nbytes = weight_bytes_read(spec, weight_dtype, batch, quant) + kv
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
    quant: OnlineQuant | None = None,
) -> Prefill:
    """One prompt's prefill: its matmuls and causal attention against peak FLOPS, never faster than reading the
    weights once per chunk; logits only for the last token. `quant` as for `decode_step`."""
    head = 2 * spec.vocab * spec.hidden
    matmul = (2 * matmul_params(spec) - head) * tokens + head
    attention = attention_flops(spec, tokens, tokens, causal=True)
    flops = matmul + attention
    steps = math.ceil(tokens / chunk_tokens)
    rate = tp * eff.compute
    t_compute = matmul / (rate * hw.peak_flops(weight_dtype)) + attention / (rate * hw.attention_rate(weight_dtype))
    t_mem = steps * weight_bytes_read(spec, weight_dtype, tokens, quant) / (tp * hw.bandwidth * eff.bandwidth)
    seconds = max(t_compute, t_mem) + steps * (step_overhead(spec, hw) + _comm(spec, hw, tokens, tp, eff))
    return Prefill(tokens, seconds, tokens / seconds, "compute" if t_compute >= t_mem else "memory", flops)


def batch_sizes(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (and `limit` itself)."""
    out = [1]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out + ([limit] if limit > out[-1] else [])
