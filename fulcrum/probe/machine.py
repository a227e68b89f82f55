"""This machine measured for `fulcrum plan --hardware local` and `--validate`, at a model's own shapes and through
the engine's own kernels and layers: streaming bandwidth as decode reads weights, matmul FLOPS at the prefill
shape, causal attention, and the framework cost of fulcrum's own decoder layer (fulcrum.models, random weights).
With an online quantization (and a KV-cache dtype) the weights and the cache are the engine's quantized ones, read
through its quantized GEMVs and matmuls. plan gets the numbers as `LocalMeasurements`."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from fulcrum.kernels import cpu_gemv, cpu_prepack, cpu_qgemv
from fulcrum.layers.attention import Attention, AttentionMetadata, attach_kv_cache
from fulcrum.models.loader import finish_loading
from fulcrum.models.registry import model_class
from fulcrum.plan.local import LocalMeasurements
from fulcrum.plan.model_spec import DTYPE_BYTES, ModelSpec
from fulcrum.plan.roofline import OnlineQuant, attention_flops, layer_matrices, weight_bytes_read
from fulcrum.quant import kv as kv_quant
from fulcrum.quant import method_factory
from fulcrum.quant.base import UnquantizedLinearMethod
from fulcrum.runtime.hugepages import huge_page_empty

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATRIX_BYTES = 16 << 20  # bandwidth probe: weight matrices of this size, read one after another like layers


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, kernel build, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # the engine's decode path on CPU: its AVX-512 GEMV kernel where it applies, else F.linear
    return cpu_gemv.linear(x, w) if x.device.type == "cpu" else F.linear(x, w)


def quantized_linear(w: torch.Tensor, quant: OnlineQuant | None) -> tuple[nn.Module, Callable]:
    """`w` [out, in] processed as the engine processes a loaded weight (fulcrum.quant's method for `quant`; the
    unquantized one, which prepacks for oneDNN on AMX, without it), and y = x W^T through that method: its
    (quantized) GEMV for few rows, the dense matmul for many."""
    layer = nn.Module()
    layer.weight = nn.Parameter(w, requires_grad=False)
    if quant is None:
        method = UnquantizedLinearMethod()
    else:
        method = method_factory(quant.method, quant.group_size)("model.layers.0.mlp.down_proj")
    method.process_weights_after_loading(layer)
    if hasattr(method, "pack_small"):  # finish_loading's second pass (AMX: a copy for few rows)
        method.pack_small(layer)
    return layer, lambda x: method.apply(layer, x, None)


def matrices_bytes(matrices: list[tuple[int, int]], itemsize: int) -> int:
    return sum(o * i for o, i in matrices) * itemsize


def decode_matrices(spec: ModelSpec, dtype: str, budget: int = 1 << 30) -> list[tuple[int, int]]:
    """The weight matrices one decode step streams, as (out, in) shapes in the order the model reads them: per
    layer q/k/v, o, gate/up and down, then the LM head. Small matrices stream slower than large ones (per-call
    cost, threads splitting fewer rows), so the probe uses the model's own. Layers repeat until `budget` bytes;
    past the caches more bytes only lengthen the probe. MoE and MLA models get generic 16 MiB matrices."""
    itemsize = DTYPE_BYTES[dtype]
    if spec.moe or spec.mla:
        total = min(weight_bytes_read(spec, dtype, 1), budget)
        rows = int(MATRIX_BYTES // (2048 * itemsize))
        return [(rows, 2048)] * max(1, round(total / (rows * 2048 * itemsize)))
    layer = layer_matrices(spec)
    layer_bytes = matrices_bytes(layer, itemsize)
    head_bytes = spec.vocab * spec.hidden * itemsize
    layers = max(1, min(spec.num_layers, int((budget - head_bytes) // layer_bytes)))
    return layer * layers + [(spec.vocab, spec.hidden)]


def measure_bandwidth(
    dtype: str,
    matrices: list[tuple[int, int]],
    batch: int = 1,
    repeats: int = 7,
    quant: OnlineQuant | None = None,
) -> float:
    """Bytes/s of weights streamed by `batch`-row GEMVs over `matrices`, one after another as decode reads them.
    A working set that fits in the last-level cache streams faster than DRAM, as a small model's weights do. With
    `quant` the weights are the engine's quantized ones (their bytes, scales included, over the time)."""
    dt = TORCH_DTYPES[dtype]
    linears, nbytes = [], 0
    for o, i in matrices:
        if quant:  # the engine keeps quantized weights where quantizing put them (buffers: not moved)
            layer, fn = quantized_linear(torch.randn(o, i).to(dt), quant)
            tensors = list(layer.buffers())
        else:  # on huge pages, as the engine places its CPU weights
            w = huge_page_empty((o, i), dt)
            w.copy_(torch.randn(o, i))
            fn, tensors = (lambda x, w=w: _linear(x, w)), [w]
        nbytes += sum(t.numel() * t.element_size() for t in tensors)
        linears.append((fn, i))
    xs = {i: torch.randn(batch, i).to(dt) for _, i in matrices}

    def run():
        for fn, i in linears:
            fn(xs[i])

    return nbytes / _median_time(run, repeats)


def measure_matmul_flops(
    dtype: str, m: int, k: int, n: int, repeats: int = 5, quant: OnlineQuant | None = None
) -> float:
    """FLOP/s of [m, k] @ [k, n], the shape of a prefill's MLP matmul, through the engine's linear method: F.linear
    (oneDNN's prepacked weight on AMX); with `quant`, the quantized layer (for a prefill: the weight dequantized for
    the call, then the dense matmul)."""
    dt = TORCH_DTYPES[dtype]
    a, b = torch.randn(m, k).to(dt), torch.randn(n, k).to(dt)
    matmul = quantized_linear(b, quant)[1]
    reps = max(1, int(2e9 // (2 * m * k * n)))  # at least ~2 GFLOP per timing, so short shapes are measurable

    def run():
        for _ in range(reps):
            matmul(a)

    return reps * 2 * m * k * n / _median_time(run, repeats)


@torch.inference_mode()
def measure_attention_flops(spec: ModelSpec, dtype: str, tokens: int, repeats: int = 5) -> float:
    """FLOP/s of one layer's causal self-attention over a `tokens`-token prompt, through fulcrum's attention layer
    (the kernels the engine picks for that shape), counted as the roofline counts attention FLOPs."""
    dt = TORCH_DTYPES[dtype]
    heads, kv_heads, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    layer = Attention(heads, kv_heads, hd, hd**-0.5)
    q = torch.randn(tokens, heads, hd).to(dt)
    k, v = torch.randn(tokens, kv_heads, hd).to(dt), torch.randn(tokens, kv_heads, hd).to(dt)
    meta = AttentionMetadata.for_prompts([tokens])
    per_layer = attention_flops(spec, tokens, tokens, causal=True) / len(spec.windows)
    return per_layer / _median_time(lambda: layer(q, k, v, meta), repeats)


def decoder_config(spec: ModelSpec, layers: int, context: int) -> PretrainedConfig:
    """A Hugging Face config of `layers` decoder layers at `spec`'s shape, in the family with its attention's
    switches (Qwen3: q/k norms; Qwen2: q/k/v biases; Llama: attention_bias on q/k/v and o), for `context` + 1
    positions and a 16-token vocabulary: the probe times the layers, not the embedding or the LM head."""
    if spec.qk_norm:
        cls, arch = Qwen3Config, "Qwen3ForCausalLM"
    elif spec.qkv_bias and not spec.o_bias:
        cls, arch = Qwen2Config, "Qwen2ForCausalLM"
    else:
        cls, arch = LlamaConfig, "LlamaForCausalLM"
    return cls(
        architectures=[arch],
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        attention_bias=spec.o_bias,
        mlp_bias=spec.mlp_bias,
        vocab_size=16,
        max_position_embeddings=context + 1,
        tie_word_embeddings=True,
    )


def decoder_layers(
    spec: ModelSpec,
    dt: torch.dtype,
    layers: int,
    context: int,
    block: int = 16,
    quant: OnlineQuant | None = None,
    kv_cache_dtype: str = "auto",
):
    """`layers` of fulcrum's own decoder layers (fulcrum.models, built from `decoder_config`) with random weights
    (quantized after "loading" as the loader does, with `quant`), with a paged KV cache of `context` tokens
    (of `kv_cache_dtype`, as the engine's); and the RoPE and attention metadata of one token decoding after them,
    shared by the layers as a step shares them. Returns (layers, rope, meta)."""
    cfg = decoder_config(spec, layers, context)
    methods = {"quant": method_factory(quant.method, quant.group_size)} if quant else {}
    model = model_class(cfg)(cfg, dtype=dt, **methods)
    for p in model.parameters():
        p.normal_(0, 0.02)
    finish_loading(model)
    blocks = -(-(context + 1) // block)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    attach_kv_cache(attns, blocks, block, dt, kv_quant.kv_format(kv_cache_dtype), "cpu")
    rope = model.model.rotary_emb(torch.tensor([context]), dt)
    meta = AttentionMetadata.for_decodes(
        torch.tensor([context]), torch.arange(blocks).view(1, blocks), torch.tensor([context + 1])
    )
    return list(model.model.layers), rope, meta


def layer_linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A decoder layer's linear layers in the order decode runs them: q/k/v, o, gate/up, down."""
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


LAYER_PROBE_BYTES = 256 << 20  # a larger layer is timed at a narrow stand-in shape (its cost is then framework only)


@torch.inference_mode()
def measure_framework_cost(
    spec: ModelSpec,
    dtype: str,
    context: int,
    repeats: int = 7,
    quant: OnlineQuant | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[float, float]:
    """Seconds a decoder layer of this model costs in a batch-1 decode step beyond its weight reads: a stack of
    distinct layers (as many of the model's as fit in LAYER_PROBE_BYTES, up to 8) run one after another as a
    step runs them, less their GEMVs timed alone on the same weights in the same run; per layer. One layer timed
    over and over read low: its weights and code stay hot in a way a step's layers do not. Also seconds per
    framework op of a layer (ops counted with the profiler), which prices the step's ops outside the layers.
    With `quant` / `kv_cache_dtype` the layers hold the engine's quantized weights / cache."""
    dt = TORCH_DTYPES.get(dtype, torch.bfloat16)
    layer_bytes = matrices_bytes(layer_matrices(spec), dt.itemsize)
    shape = spec
    if spec.moe or spec.mla or layer_bytes > LAYER_PROBE_BYTES:  # no dense GQA layer of its own size
        shape = dataclasses.replace(spec, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128)
        layer_bytes = matrices_bytes(layer_matrices(shape), dt.itemsize)
        if quant:  # int4 groups that divide the stand-in's inputs
            quant = dataclasses.replace(quant, group_size=min(quant.group_size, 64))
    n = max(1, min(spec.num_layers, 8, LAYER_PROBE_BYTES // max(layer_bytes, 1)))
    layers, rope, meta = decoder_layers(shape, dt, n, context, quant=quant, kv_cache_dtype=kv_cache_dtype)
    x = torch.randn(1, shape.hidden).to(dt)
    linears = [(lin, torch.randn(1, lin.input_size).to(dt)) for layer in layers for lin in layer_linears(layer)]
    iters = max(1, 20 // n)
    # kineto, the profiler's backend, prints "USDT:" lines on every start and stop unless told otherwise before
    # its first use in the process; 6 is above its highest severity. A level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import profile

    for layer in layers:
        layer(rope, x, meta)  # warm-up; on PyTorch's decode path the step's decode mask is built here, once
    with profile() as prof:
        layers[0](rope, x, meta)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)

    def whole():
        for _ in range(iters):
            h = x
            for layer in layers:
                h = layer(rope, h, meta)

    def gemvs():
        for _ in range(iters):
            for lin, xi in linears:
                lin(xi)

    whole()
    gemvs()
    diffs = []  # back to back, so both see the same memory and caches; the median of the differences
    for _ in range(repeats):
        t0 = time.perf_counter()
        whole()
        t1 = time.perf_counter()
        gemvs()
        diffs.append((t1 - t0) - (time.perf_counter() - t1))
    per_layer = max(statistics.median(diffs) / (iters * n), 0.0)
    return per_layer, per_layer / ops


def memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_machine(
    spec: ModelSpec,
    dtype: str = "bf16",
    matmul_tokens: int = 512,
    batch_sizes: tuple[int, ...] = (1,),
    decode_context: int = 512,
    quant: OnlineQuant | None = None,
    kv_cache_dtype: str = "auto",
) -> LocalMeasurements:
    """This machine measured at `spec`'s shapes in the dtype the model runs in (CPUs have no fp8/fp4 matmuls):
    decode's weight streaming, a prefill MLP matmul of `matmul_tokens` tokens, causal attention, and a decoder
    layer's framework cost decoding over `decode_context` cached tokens. With `quant` (one of the engine's online
    quantizations) the weights streamed, the matmul and the layers are quantized as the engine quantizes them; with
    `kv_cache_dtype` (the engine's fp8, int8) the layers' KV cache is."""
    dtype = dtype if dtype in TORCH_DTYPES else "bf16"
    matrices, dt = decode_matrices(spec, dtype), TORCH_DTYPES[dtype]
    if quant:
        working_set, weights = sum(quant.matrix_bytes(o, i) for o, i in matrices), quant.name
        kernel = f"fulcrum's quantized GEMV up to {cpu_qgemv.max_rows(dt)} rows, dequantize + F.linear beyond"
        if not cpu_qgemv.available():
            kernel = "dequantize + F.linear (no quantized GEMV kernel here)"
    else:
        working_set, weights = matrices_bytes(matrices, DTYPE_BYTES[dtype]), dtype
        limit = cpu_gemv.MAX_ROWS[cpu_gemv.level()].get(dt, 0)
        beyond = "F.linear"
        if cpu_prepack.supported():  # packed from min_rows on
            widened = " (widened to fp32 at load)" if cpu_prepack.packed_dtype(dt) != dt else ""
            layout = "fulcrum's blocked" if cpu_prepack.blocked_dtype(dt) else "oneDNN's prepacked"
            beyond, limit = f"{layout} weight{widened}", min(limit, cpu_prepack.min_rows(dt) - 1)
        elif dt == torch.bfloat16 and not cpu_gemv.native_bf16_matmul():
            beyond = "the weight widened to fp32 + F.linear"
        kernel = f"{'fulcrum GEMV kernel' if cpu_gemv.available() else 'F.linear'} up to {limit} rows, {beyond} beyond"
    matmul_shape = (matmul_tokens, spec.hidden, spec.intermediate)
    by_batch = {b: measure_bandwidth(dtype, matrices, batch=b, quant=quant) for b in sorted({1, *batch_sizes})}
    flops = measure_matmul_flops(dtype, *matmul_shape, quant=quant)
    # past a couple of thousand tokens the rate is flat, and the probe's score matrices would grow quadratically
    attention_tokens = min(matmul_tokens, 2048)
    attention = None if spec.mla else measure_attention_flops(spec, dtype, attention_tokens)
    layer_s, op = measure_framework_cost(spec, dtype, decode_context, quant=quant, kv_cache_dtype=kv_cache_dtype)
    streams = ", ".join(f"batch {b}: {v / 1e9:.1f} GB/s" for b, v in by_batch.items())
    via = f" through the engine's {weights} layer" if quant else ""
    cache = f", KV cache {kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
    return LocalMeasurements(
        dtype=dtype,
        threads=torch.get_num_threads(),
        memory_bytes=memory_bytes(),
        bandwidth_by_batch=by_batch,
        matmul_flops=flops,
        attention_flops=attention,
        layer_overhead_s=layer_s,
        op_latency_s=op,
        notes=[
            f"weight streaming ({streams}): GEMVs over the model's {len(matrices)} weight matrices, "
            f"{working_set / 2**20:.1f} MiB of {weights}, through the engine's decode path ({kernel}), median of 7",
            f"matmul {flops / 1e9:.0f} GFLOP/s {dtype} at {'x'.join(map(str, matmul_shape))}{via}, median of 5",
            *(
                [
                    f"causal attention {attention / 1e9:.0f} GFLOP/s {dtype} over {attention_tokens} tokens (fulcrum's "
                    "attention layer), median of 5"
                ]
                if attention
                else []
            ),
            f"framework cost {layer_s * 1e6:.0f} us per decoder layer beyond its GEMVs, {op * 1e6:.1f} us per op: "
            f"fulcrum's decoder layer at this shape{' (' + weights + ')' if quant else ''}, batch 1 over "
            f"{decode_context} cached tokens{cache}",
        ],
    )
