"""`--hardware local`: this machine measured, not looked up: streaming bandwidth as decode reads weights,
matmul FLOPS at the model's prefill shape, and the latency of one eager framework op."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from fulcrum.layers.attention import Attention, AttentionMetadata
from fulcrum.plan.catalog import Hardware
from fulcrum.plan.model_spec import DTYPE_BYTES, ModelSpec
from fulcrum.plan.roofline import Efficiency, attention_flops, weight_bytes_read
from fulcrum.quant import cpu_gemv

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATRIX_BYTES = 16 << 20
# The local figures are measured at the workload's own shapes with the engine's kernels, so they already are
# what the kernels reach: no further efficiency factor. (One machine: no all-reduce.)
LOCAL_EFFICIENCY = Efficiency(
    bandwidth=1.0, compute=1.0, allreduce_latency_s=0.0
)  # bandwidth probe: weight matrices of this size, read one after another like layers


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
    h, hd = spec.hidden, spec.head_dim
    layer = [
        ((spec.num_heads + 2 * spec.num_kv_heads) * hd, h),
        (h, spec.num_heads * hd),
        (2 * spec.intermediate, h),
        (h, spec.intermediate),
    ]
    layer_bytes = sum(o * i for o, i in layer) * itemsize
    head_bytes = spec.vocab * h * itemsize
    layers = max(1, min(spec.num_layers, int((budget - head_bytes) // layer_bytes)))
    return layer * layers + [(spec.vocab, h)]


def measure_bandwidth(dtype: str, matrices: list[tuple[int, int]], batch: int = 1, repeats: int = 7) -> float:
    """Bytes/s of weights streamed by `batch`-row GEMVs over `matrices`, one after another as decode reads them.
    A working set that fits in the last-level cache streams faster than DRAM, as a small model's weights do."""
    dt = TORCH_DTYPES[dtype]
    mats = [torch.randn(o, i).to(dt) for o, i in matrices]
    xs = {i: torch.randn(batch, i).to(dt) for _, i in matrices}

    def run():
        for w in mats:
            _linear(xs[w.shape[1]], w)

    return sum(w.numel() * dt.itemsize for w in mats) / _median_time(run, repeats)


def measure_matmul_flops(dtype: str, m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of [m, k] @ [k, n], the shape of a prefill's MLP matmul."""
    dt = TORCH_DTYPES[dtype]
    a, b = torch.randn(m, k).to(dt), torch.randn(n, k).to(dt)
    reps = max(1, int(2e9 // (2 * m * k * n)))  # at least ~2 GFLOP per timing, so short shapes are measurable

    def run():
        for _ in range(reps):
            F.linear(a, b)

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


class _TinyDecoderLayer(torch.nn.Module):
    """An eager decoder layer (RMSNorm, GQA attention with RoPE and a KV-cache write, gated MLP) so narrow that
    its time is all framework overhead: what one op costs when it does nearly no work."""

    def __init__(self, hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 128, cache: int = 64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.o = torch.nn.Linear(heads * self.hd, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        self.register_buffer("k_cache", torch.zeros(cache, kv_heads, self.hd))
        self.register_buffer("v_cache", torch.zeros(cache, kv_heads, self.hd))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.hd, *[self.kv_heads * self.hd] * 2], dim=-1)
        q = self.rope(q.view(-1, self.heads, self.hd), pos)
        k = self.rope(k.view(-1, self.kv_heads, self.hd), pos)
        self.k_cache.index_copy_(0, pos, k)
        self.v_cache.index_copy_(0, pos, v.view(-1, self.kv_heads, self.hd))
        n = int(pos[-1]) + 1
        keys = self.k_cache[:n].transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        vals = self.v_cache[:n].transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals)
        x = x + self.o(a.transpose(0, 1).reshape(x.shape[0], -1))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


@torch.inference_mode()
def measure_op_latency(repeats: int = 7, iters: int = 200) -> float:
    """Seconds per framework op of an eager decoder layer at batch 1 (ops counted with the profiler)."""
    layer = _TinyDecoderLayer()
    x, pos = torch.randn(1, 64), torch.tensor([10])
    from torch.profiler import profile

    with profile() as prof:
        layer(x, pos)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)

    def run():
        for _ in range(iters):
            layer(x, pos)

    return _median_time(run, repeats) / (iters * ops)


def memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_hardware(
    spec: ModelSpec,
    dtype: str = "bf16",
    matmul_tokens: int = 512,
    batch_sizes: tuple[int, ...] = (1,),
) -> Hardware:
    """This machine as a catalog entry, measured at `spec`'s shapes in the dtype the model runs in (CPUs have
    no fp8/fp4 matmuls): decode's weight streaming, and a prefill MLP matmul of `matmul_tokens` tokens."""
    dtype = dtype if dtype in TORCH_DTYPES else "bf16"
    matrices = decode_matrices(spec, dtype)
    working_set = sum(o * i for o, i in matrices) * DTYPE_BYTES[dtype]
    matmul_shape = (matmul_tokens, spec.hidden, spec.intermediate)
    by_batch = {b: measure_bandwidth(dtype, matrices, batch=b) for b in sorted({1, *batch_sizes})}
    bw = by_batch[1]
    flops = measure_matmul_flops(dtype, *matmul_shape)
    # past a couple of thousand tokens the rate is flat, and the probe's score matrices would grow quadratically
    attention_tokens = min(matmul_tokens, 2048)
    attention = None if spec.mla else measure_attention_flops(spec, dtype, attention_tokens)
    op = measure_op_latency()
    kernel = "fulcrum GEMV kernel" if cpu_gemv.available() else "F.linear"
    streams = ", ".join(f"batch {b}: {v / 1e9:.1f} GB/s" for b, v in by_batch.items())
    return Hardware(
        name="local",
        memory_bytes=memory_bytes(),
        bandwidth=bw,
        flops={dtype: flops, "bf16": flops} if dtype != "bf16" else {"bf16": flops},
        interconnect="none",
        formats=(dtype,),
        source=f"measured on this machine, {torch.get_num_threads()} threads",
        op_latency_s=op,
        bandwidth_by_batch=by_batch,
        attention_flops=attention,
        notes=[
            f"weight streaming ({streams}): GEMVs over the model's {len(matrices)} weight matrices, "
            f"{working_set / 2**20:.0f} MiB of {dtype}, through the engine's decode path ({kernel} up to {cpu_gemv.MAX_ROWS} rows, F.linear beyond), median of 7",
            f"matmul {flops / 1e9:.0f} GFLOP/s {dtype} at {'x'.join(map(str, matmul_shape))}, median of 5",
            *(
                [
                    f"causal attention {attention / 1e9:.0f} GFLOP/s {dtype} over {attention_tokens} tokens (fulcrum's "
                    "attention layer), median of 5"
                ]
                if attention
                else []
            ),
            f"framework op {op * 1e6:.1f} us: an eager decoder layer 64 wide at batch 1, per profiled op",
        ],
    )
