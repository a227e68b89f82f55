"""Block-wise fp8 checkpoints (quant_method "fp8" with weight_block_size, as DeepSeek-V3/R1 and the Qwen3-*-FP8
releases ship them): each linear weight float8_e4m3fn [O, I] with `weight_scale_inv` fp32 [ceil(O / b0),
ceil(I / b1)], one per tile, W = q * scale_inv of its tile. activation_scheme "dynamic" only (the activations then
run unquantized: the weights are what is read).

The tile scales widen at load to one per weight row and block of b1 inputs: exact, and it lets q/k/v or gate/up
shards whose sizes are not multiples of b0 stack, and tensor parallelism cut rows anywhere (inputs only in whole
blocks). The weights stay fp8 in memory. A layer with one block of inputs then has a scale per output channel: the
online fp8 method's layout, whose kernels (and the fused decode stack) run it unchanged. A layer with several keeps
its [O, I] bytes (padded to whole blocks) with scales [O, blocks]: few rows run the fp8g CPU kernel
(kernels/csrc/qgemv.cpp), which reads the fp8 bytes and applies each block's scale to its partial sums; many rows
widen the weight once per call and run one dense matmul. The MoE experts (fulcrum.layers.moe) are held the same
way, each expert's GEMM a `block_linear`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fulcrum.errors import ModelLoadError, WeightLoadError, WeightShapeError
from fulcrum.kernels import cpu_gemv, cpu_qgemv
from fulcrum.quant import formats
from fulcrum.quant.checkpoint import FLOATS, CheckpointFormat, shard_index, unsupported
from fulcrum.quant.online import Fp8Method

ACTIVATION_SCHEMES = ("dynamic",)
# the fp8g kernel up to this many rows, in fp32 and bf16 alike, then the widened weight. Past ~16 rows widening is
# faster (a 4096 x 4096 layer in bf16 on 2 AVX-512 BF16 cores loaded by other jobs: 8.8 / 16.7 / 25.5 / 50 ms at
# 8 / 16 / 32 / 64 rows in the kernel, 16.2 / 17.8 / 16.4 / 24.6 ms widened), but in bf16 it rounds the weight, and
# with it MoE experts' prefill rows (a few to a few dozen each) lost the accuracy that keeps the bf16 logits as close
# to the fp32 reference as transformers' own bf16 run (tests/quant/test_fp8_block.py)
KERNEL_MAX_ROWS = 64
FP8_FORMATS = ("e4m3",)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def read_block(config: dict) -> tuple[int, int]:
    """The checked weight_block_size of an fp8 quantization_config."""
    block = config.get("weight_block_size")
    if block is None:
        raise ModelLoadError(
            "quant_method fp8 without weight_block_size (one scale per tensor or channel) is not supported; "
            "fulcrum reads block-wise fp8 checkpoints (weight_block_size, e.g. [128, 128], and *.weight_scale_inv)"
        )
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ModelLoadError(f"fp8 weight_block_size must be two positive whole numbers [rows, columns], got {block!r}")
    return int(block[0]), int(block[1])


class BlockFp8Format(CheckpointFormat):
    """Every linear layer quantized but the LM head (stored in full precision, as transformers and vLLM load it),
    modules_to_not_convert and ignored_layers (matched by whole name components: "mlp.gate" names the router), and
    the MoE routers, which are no linear layers here."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.block = read_block(config)
        scheme = str(config.get("activation_scheme") or "dynamic").lower()
        if scheme not in ACTIVATION_SCHEMES:
            raise unsupported("fp8 activation_scheme", scheme, ACTIVATION_SCHEMES)
        fmt = str(config.get("fmt") or "e4m3").lower()
        if fmt not in FP8_FORMATS:
            raise unsupported("fp8 fmt", fmt, FP8_FORMATS)
        self.skip = [*(config.get("modules_to_not_convert") or []), *(config.get("ignored_layers") or [])]

    def scheme(self, name):
        if name == "lm_head" or name.endswith(".lm_head"):
            return None
        dotted = f".{name}."
        if any(f".{m.strip('.')}." in dotted for m in self.skip):
            return None
        return self.block

    def method(self, scheme, prefix, shard_names):
        return BlockFp8Method(scheme, prefix, shard_names)

    def experts(self, prefix: str) -> tuple[int, int] | None:
        """The block size the routed experts under `prefix` ("model.layers.3.mlp.experts") are stored in, or None
        where the checkpoint keeps them in full precision."""
        return self.scheme(f"{prefix}.0.gate_proj")

    def describe(self) -> str:
        return f"fp8 e4m3, block-wise ({self.block[0]}x{self.block[1]} scales), dynamic activations run unquantized"


def to_row_blocks(q: torch.Tensor, scales: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., O, I] fp8 with scales [..., O, blocks] (one per row and block of `cols` inputs) as the fp8g kernel
    reads them: q padded with zeros to [..., O, blocks * cols] where a last block is cut short (so is the input, in
    `block_linear`), the scales contiguous."""
    *lead, out_f, in_f = q.shape
    blocks = scales.shape[-1]
    if blocks * cols != in_f:
        padded = torch.zeros(*lead, out_f, blocks * cols, dtype=q.dtype, device=q.device)
        padded[..., :in_f] = q
        q = padded
    return q.contiguous(), scales.contiguous()


def _kernel_reads(q: torch.Tensor, cols: int) -> bool:
    return q.device.type == "cpu" and cols % cpu_qgemv.FP8G_MULTIPLE == 0 and cpu_qgemv.available()


def widen_blocks(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight in `to_row_blocks`' layout as [O, blocks * cols] in `dtype`, each value q * its scale rounded once.
    On CPU the result lies in a buffer the next call reuses: use it at once (or clone it)."""
    out_f, width = q.shape
    cols = width // scales.shape[1]
    if _kernel_reads(q, cols) and dtype in (torch.float32, torch.bfloat16):
        return cpu_qgemv.dequantize_fp8g(q, scales, cols, dtype)
    return (q.float().view(out_f, -1, cols) * scales.float()[..., None]).view(out_f, width).to(dtype)


def block_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., I] @ W^T + bias for a weight in `to_row_blocks`' layout. Few rows on CPU: the fp8g kernel, which reads
    the fp8 bytes and each block's scale as stored; many rows (or a block the kernel cannot step through): the
    weight widened for this call, then one dense matmul."""
    out_f, width = q.shape
    cols = width // scales.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if width != x2.shape[1]:
        x2 = torch.nn.functional.pad(x2, (0, width - x2.shape[1]))
    if _kernel_reads(q, cols) and cpu_qgemv.usable(x2, bias, KERNEL_MAX_ROWS):
        y = cpu_qgemv.fp8g(x2, q, scales, cols, bias)
    else:
        y = cpu_gemv.linear(x2, widen_blocks(q, scales, x.dtype), bias)
    return y.reshape(*lead, out_f)


def full_rows(layer: nn.Module, index: int) -> int:
    """Shard `index`'s rows in the checkpoint: the layer holds this rank's."""
    local = layer.output_sizes[index]
    if layer.tp_size == 1 or layer.tp_dim != 0:
        return local
    if index > 0 and hasattr(layer, "kv_replicas"):  # k and v of QKVParallelLinear: heads replicated past tp
        return layer.num_kv_heads * layer.head_dim * layer.tp_size // layer.kv_replicas
    return local * layer.tp_size


class BlockFp8Method(Fp8Method):
    """A linear layer from a block-wise fp8 checkpoint. The layer's own weight_loader cuts each tensor for this rank
    and places each shard (q/k/v, gate/up): `weight` as stored, `weight_scale_inv` once widened to rows. After loading
    qweight is the fp8 weight and scales [O, ceil(I / b1)] (or [O] where there is one block of inputs)."""

    def __init__(self, block: tuple[int, int], prefix: str, shard_names: list[str]):
        self.block, self.prefix, self.shard_names = block, prefix, shard_names

    def create_weights(self, layer, input_size, output_sizes, dtype):
        rows, cols = self.block
        self.full_input = input_size * (layer.tp_size if layer.tp_dim == 1 else 1)
        if layer.tp_dim == 1 and layer.tp_size > 1 and input_size % cols:
            raise ModelLoadError(
                f"{self.prefix}: tensor parallel {layer.tp_size} splits its {self.full_input} inputs into "
                f"{input_size} per rank, not a multiple of the checkpoint's fp8 block of {cols} inputs, so its "
                "scales cannot split with it; use a tensor-parallel size that divides the blocks"
            )
        weight = nn.Parameter(
            torch.zeros(sum(output_sizes), input_size, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        weight.weight_loader = functools.partial(self.load_weight, layer)
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(
            torch.zeros(sum(output_sizes), cdiv(input_size, cols), dtype=torch.float32), requires_grad=False
        )
        scale.weight_loader = functools.partial(self.load_scale, layer)
        layer.register_parameter("weight_scale_inv", scale)
        layer.out_dtype = dtype

    def load_weight(self, layer, param, loaded, shard_id=None):
        if loaded.dtype != torch.float8_e4m3fn:
            raise WeightLoadError(f"dtype {loaded.dtype}, a block-wise fp8 checkpoint stores it as float8_e4m3fn")
        layer.weight_loader(param, loaded, shard_id)

    def load_scale(self, layer, param, loaded, shard_id=None):
        if loaded.dtype not in FLOATS:
            raise WeightLoadError(f"dtype {loaded.dtype}, fp8 block scales are floats (float32)")
        rows = full_rows(layer, shard_index(shard_id))
        expected = (cdiv(rows, self.block[0]), cdiv(self.full_input, self.block[1]))
        if tuple(loaded.shape) != expected:  # one scale per [b0, b1] tile of the weight
            raise WeightShapeError(expected, tuple(loaded.shape))
        layer.weight_loader(param, formats.fp8_block_rows(loaded, self.block[0], rows), shard_id)

    def process_weights_after_loading(self, layer):
        q, scales = layer.weight.data, layer.weight_scale_inv.data
        del layer.weight, layer.weight_scale_inv
        if scales.shape[1] == 1:  # one block of inputs: a scale per output channel, what the fp8 kernels read
            layer.register_buffer("qweight", q)
            layer.register_buffer("scales", scales[:, 0].contiguous())
            return
        qweight, scales = to_row_blocks(q, scales, self.block[1])
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scales", scales)
        self.input_size = q.shape[1]

    def dequantize(self, layer):
        if layer.scales.dim() == 1:
            return super().dequantize(layer)
        return widen_blocks(layer.qweight, layer.scales, torch.float32)[:, : self.input_size].clone()

    def dequantize_rows(self, layer, rows):
        if layer.scales.dim() == 1:
            return super().dequantize_rows(layer, rows)
        return self.dequantize(layer)[rows]

    def apply(self, layer, x, bias):
        if layer.scales.dim() == 1:
            return super().apply(layer, x, bias)
        return block_linear(x, layer.qweight, layer.scales, bias)

    def decode_stack_weight(self, layer):
        return super().decode_stack_weight(layer) if layer.scales.dim() == 1 else None


class BlockFp8Experts:
    """The `quant_method` of a StackedExpertWeight (fulcrum.layers.moe) from a block-wise fp8 checkpoint: once loaded,
    its weight [E, rows, I] and widened scales [E, rows, blocks] take `to_row_blocks`' layout, each expert's as a
    linear layer's, and each expert's GEMM is `block_linear`."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def process_weights_after_loading(self, module: nn.Module) -> None:
        q, scales = module.weight.data, module.weight_scale_inv.data
        del module.weight, module.weight_scale_inv
        qweight, scales = to_row_blocks(q, scales, self.block[1])
        module.register_buffer("qweight", qweight)
        module.register_buffer("scales", scales)
        module.input_size = q.shape[-1]
