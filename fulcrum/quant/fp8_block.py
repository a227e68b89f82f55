"""Block-wise fp8 checkpoints (quant_method "fp8" with weight_block_size, as DeepSeek-V3/R1 and the Qwen3-*-FP8
releases ship them): each linear weight float8_e4m3fn [O, I] with `weight_scale_inv` fp32 [ceil(O / b0),
ceil(I / b1)], one per tile, W = q * scale_inv of its tile. activation_scheme "dynamic" only (the activations then
run unquantized: the weights are what is read).

The tile scales widen at load to one per weight row and block of b1 inputs: exact, and it lets q/k/v or gate/up
shards whose sizes are not multiples of b0 stack, and tensor parallelism cut rows anywhere (inputs only in whole
blocks). The weights stay fp8 in memory. A layer with one block of inputs then has a scale per output channel: the
online fp8 method's layout, whose kernels (and the fused decode stack) run it unchanged. A layer with several is held
block-major, [blocks, O, b1] with scales [blocks, O], so that each block of inputs is an fp8 matrix with per-channel
scales: few rows run the fp8 GEMV once per block, summed in fp32; many rows widen the weight once per call through the
same kernel and run one dense matmul (no kernel reads an fp8 scale per block of inputs yet). The MoE experts
(fulcrum.layers.moe) go block-major the same way, each expert's GEMM a `block_linear`. Measured on this CPU (shared
with other jobs, 2 cores, AVX-512 BF16), bf16: a 4096 x 4096 layer takes 1.2 ms a row against 0.5 ms for the same
weights in bf16, 256 rows 35 ms against 20 ms (fp32: 1.2 ms a row against 1.6-1.9 ms); an expert's 1536 x 2048
gate/up 0.33 ms a row against 1.7 ms for widening it whole first.
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


def to_block_major(q: torch.Tensor, scales: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., O, I] fp8 with scales [..., O, blocks] (one per row and block of `cols` inputs) -> ([..., blocks, O,
    cols], [..., blocks, O]): each block of inputs an fp8 matrix with a scale per output channel, as the fp8 GEMV
    reads one; a last block cut short padded with zeros (and so is the input, in `block_linear`), a single one not."""
    *lead, out_f, in_f = q.shape
    blocks = scales.shape[-1]
    cols = in_f if blocks == 1 else cols  # one block: the whole row, nothing to pad
    padded = torch.zeros(*lead, out_f, blocks * cols, dtype=q.dtype, device=q.device)
    padded[..., :in_f] = q
    return padded.view(*lead, out_f, blocks, cols).transpose(-3, -2).contiguous(), scales.transpose(-1, -2).contiguous()


def widen_blocks(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block-major weight ([blocks, O, b1], scales [blocks, O]) as [O, blocks * b1] in `dtype`, each value
    q * scale rounded once: each row of each block has one scale, so the fp8 kernel's per-channel widening does it
    (then the blocks are laid side by side)."""
    blocks, out_f, cols = q.shape
    flat = q.view(blocks * out_f, cols)
    if q.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_qgemv.available():
        w = cpu_qgemv.dequantize_int8(flat, scales.reshape(-1), dtype)
    else:
        w = formats.dequantize_fp8(flat, scales.reshape(-1)).to(dtype)
    return w.view(blocks, out_f, cols).transpose(0, 1).reshape(out_f, blocks * cols)


def block_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., I] @ W^T + bias for a block-major fp8 weight (`to_block_major`). Few rows on CPU: the fp8 GEMV once
    per block of inputs, summed in fp32 and rounded once; many rows: the weight widened for this call, then one dense
    matmul."""
    blocks, out_f, cols = q.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if blocks * cols != x2.shape[1]:
        x2 = torch.nn.functional.pad(x2, (0, blocks * cols - x2.shape[1]))
    xf = x2.float()
    if cpu_qgemv.usable(xf):
        y = cpu_qgemv.int8(xf[:, :cols].contiguous(), q[0], scales[0])
        for j in range(1, blocks):
            y += cpu_qgemv.int8(xf[:, j * cols : (j + 1) * cols].contiguous(), q[j], scales[j])
        if bias is not None:
            y += bias.float()
        y = y.to(x.dtype)
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
        qweight, scales = to_block_major(q, scales, self.block[1])
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scales", scales)
        self.input_size = q.shape[1]

    def dequantize(self, layer):
        if layer.qweight.dim() == 2:
            return super().dequantize(layer)
        return widen_blocks(layer.qweight, layer.scales, torch.float32)[:, : self.input_size].clone()

    def dequantize_rows(self, layer, rows):
        if layer.qweight.dim() == 2:
            return super().dequantize_rows(layer, rows)
        return self.dequantize(layer)[rows]

    def apply(self, layer, x, bias):
        if layer.qweight.dim() == 2:
            return super().apply(layer, x, bias)
        return block_linear(x, layer.qweight, layer.scales, bias)

    def decode_stack_weight(self, layer):
        return super().decode_stack_weight(layer) if layer.qweight.dim() == 2 else None


class BlockFp8Experts:
    """The `quant_method` of a StackedExpertWeight (fulcrum.layers.moe) from a block-wise fp8 checkpoint: once loaded,
    its weight [E, rows, I] and widened scales [E, rows, blocks] go block-major, each expert's as a linear layer's
    (`to_block_major`), and each expert's GEMM is `block_linear`."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def process_weights_after_loading(self, module: nn.Module) -> None:
        q, scales = module.weight.data, module.weight_scale_inv.data
        del module.weight, module.weight_scale_inv
        qweight, scales = to_block_major(q, scales, self.block[1])
        module.register_buffer("qweight", qweight)
        module.register_buffer("scales", scales)
        module.input_size = q.shape[-1]
