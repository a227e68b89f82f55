"""Online weight-only quantization: a 16/32-bit checkpoint loads as usual, then each linear weight is quantized
in place (int8 per channel, int4 per group), and the full-precision copy is freed. Few rows (decode) go through
`cpu_qgemv`, which reads the packed bytes; many rows through a dequantized copy and a dense matmul (`matmul`). Off
CPU, or where the kernel is missing, the same dequantized matmul in PyTorch ops: slower, never wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.errors import ModelLoadError
from fulcrum.kernels import cpu_gemv, cpu_qgemv, cpu_qgemv_vnni
from fulcrum.kernels.cpu_decode_stack import Part, QuantWeight
from fulcrum.quant import formats
from fulcrum.quant.base import UnquantizedLinearMethod


class OnlineQuantMethod(UnquantizedLinearMethod):
    """Weights are created and loaded in full precision (the unquantized method's), quantized after loading."""

    name = ""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        self.check_shape(layer, w.shape)
        for key, value in self.quantize(w).items():
            layer.register_buffer(key, value.to(w.device))
        layer.out_dtype = w.dtype
        del layer.weight  # the loaded full-precision tensor is freed (a tied embedding keeps its own reference)

    def check_shape(self, layer: nn.Module, shape: torch.Size) -> None:
        pass

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer computes with, as fp32 [O, I]: the reference for kernels and tests."""
        raise NotImplementedError

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the weight as fp32 [len(rows), I] (a tied embedding's lookup)."""
        raise NotImplementedError

    def apply(self, layer, x, bias):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if cpu_qgemv.usable(x2, bias) or self.vnni_usable(layer, x2, bias):  # CPU, few rows
            y = self.gemv(layer, x2, bias)
        else:
            y = self.matmul(layer, x2, bias)
        return y.reshape(*lead, y.shape[-1])

    def vnni_usable(self, layer, x, bias) -> bool:
        """Whether the integer-dot kernel (bf16 rows, up to cpu_qgemv_vnni.MAX_ROWS) takes these rows: on AVX-512
        VNNI, `cpu_qgemv_vnni`'s integer dot products on int8-quantized inputs."""
        return False

    def gemv(self, layer, x, bias):
        raise NotImplementedError

    def matmul(self, layer, x, bias):
        """Many rows (prefill, large batches): the weight dequantized in the input's dtype for this call only (by the
        kernel on CPU), then a dense matmul, which beat torch's packed int8/int4 matmuls here in fp32 and in bf16."""
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and cpu_qgemv.available():
            if x.dtype == torch.bfloat16 and not cpu_gemv.native_bf16_matmul():  # fp32 GEMM, as cpu_gemv.linear
                b = None if bias is None else bias.float()
                return F.linear(x.float(), self.dequantize_fast(layer, torch.float32), b).to(x.dtype)
            return F.linear(x, self.dequantize_fast(layer, x.dtype), bias)
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)

    def dequantize_fast(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` by the CPU kernel, in its reused buffer."""
        raise NotImplementedError


class Int8Method(OnlineQuantMethod):
    """int8 weights, one symmetric scale per output channel."""

    name = "int8"
    # one byte per weight and a scale per channel: fp8 is the same layout with another element type
    quantize_channels = staticmethod(formats.quantize_int8)
    dequantize_channels = staticmethod(formats.dequantize_int8)

    def quantize(self, w):
        q, scale = self.quantize_channels(w)
        return {"qweight": q, "scales": scale}

    def dequantize(self, layer):
        return self.dequantize_channels(layer.qweight, layer.scales)

    def dequantize_rows(self, layer, rows):
        return self.dequantize_channels(layer.qweight[rows], layer.scales[rows])

    def vnni_usable(self, layer, x, bias):
        return layer.qweight.dtype == torch.int8 and cpu_qgemv_vnni.usable(x, bias)

    def gemv(self, layer, x, bias):
        if self.vnni_usable(layer, x, bias):
            return cpu_qgemv_vnni.int8(x, layer.qweight, layer.scales, bias)
        return cpu_qgemv.int8(x, layer.qweight, layer.scales, bias)

    def dequantize_fast(self, layer, dtype):
        return cpu_qgemv.dequantize_int8(layer.qweight, layer.scales, dtype)

    def decode_stack_weight(self, layer):
        kind = "FP8" if layer.qweight.dtype == torch.float8_e4m3fn else "INT8"
        return QuantWeight([Part(kind, layer.qweight, layer.scales)], layer.qweight.shape[1], layer.out_dtype)

    def matmul(self, layer, x, bias):
        if scaled_mm_usable(x, layer.qweight):  # fp8 weights on a GPU with fp8 tensor cores
            return fp8_scaled_mm(x, layer.qweight, layer.scales, bias)
        return super().matmul(layer, x, bias)


class Int4Method(OnlineQuantMethod):
    """int4 weights in groups of `group_size` inputs, each with a scale and a zero point."""

    name = "int4"

    def __init__(self, group_size: int = 128):
        self.group_size = group_size

    def check_shape(self, layer, shape):
        if shape[1] % self.group_size:
            fits = [g for g in formats.INT4_GROUP_SIZES if shape[1] % g == 0]
            raise ModelLoadError(
                f"int4 with group size {self.group_size} needs input features divisible by it; a "
                f"{type(layer).__name__} has {shape[1]}"
                + (f" (group sizes that fit: {', '.join(map(str, fits))})" if fits else " (no int4 group size fits)")
            )

    def quantize(self, w):
        packed, scale, offset = formats.quantize_int4(w, self.group_size)
        return {"qweight": packed, "scales": scale, "offsets": offset}

    def dequantize(self, layer):
        return formats.dequantize_int4(layer.qweight, layer.scales, layer.offsets)

    def dequantize_rows(self, layer, rows):
        offsets = None if layer.offsets is None else layer.offsets[rows]  # None: GGUF Q4_0's zero point 8
        return formats.dequantize_int4(layer.qweight[rows], layer.scales[rows], offsets)

    def vnni_usable(self, layer, x, bias):
        return cpu_qgemv_vnni.usable(x, bias, "int4")

    def gemv(self, layer, x, bias):
        if self.vnni_usable(layer, x, bias):
            return cpu_qgemv_vnni.int4(x, layer.qweight, layer.scales, layer.offsets, self.group_size, bias)
        return cpu_qgemv.int4(x, layer.qweight, layer.scales, layer.offsets, self.group_size, bias)

    def dequantize_fast(self, layer, dtype):
        return cpu_qgemv.dequantize_int4(layer.qweight, layer.scales, layer.offsets, self.group_size, dtype)

    def decode_stack_weight(self, layer):
        if getattr(layer, "input_perm", None) is not None:  # GPTQ's act order permutes the input first
            return None
        part = Part("INT4", layer.qweight, layer.scales, layer.offsets, self.group_size)
        return QuantWeight([part], layer.qweight.shape[1] * 2, layer.out_dtype)


def scaled_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """CUDA with fp8 tensor cores (compute capability 8.9 and later), fp8 e4m3 weights, sizes multiples of 16."""
    return (
        x.is_cuda
        and w.dtype == torch.float8_e4m3fn
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
        and x.shape[-1] % 16 == 0
        and w.shape[0] % 16 == 0
    )


def fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T through torch._scaled_mm: x [M, K] quantized to fp8 on the fly with one dynamic scale per row
    (its largest magnitude over 448), the fp8 matmul with fp32 accumulation, then each row's and each output
    channel's scale applied to the fp32 result."""
    xf = x.float()
    sx = (xf.abs().amax(-1, keepdim=True) / formats.FP8_MAX).clamp(min=1e-12)
    xq = (xf / sx).clamp(-formats.FP8_MAX, formats.FP8_MAX).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    y = y * sx * scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Fp8Method(Int8Method):
    """fp8 (e4m3) weights, one scale per output channel; on CPU stored as fp8 and widened in the kernel, on CUDA
    with fp8 tensor cores multiplied in fp8 by torch._scaled_mm (the activations quantized per row)."""

    name = "fp8"
    quantize_channels = staticmethod(formats.quantize_fp8)
    dequantize_channels = staticmethod(formats.dequantize_fp8)
