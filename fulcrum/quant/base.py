"""The quantization seam of linear layers: a `LinearMethod` owns a layer's weight format and matmul.

A quantized checkpoint format (int8, fp8, AWQ/GPTQ int4) is a subclass; the models never change.
"""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.kernels import cpu_gemv, cpu_prepack


class LinearMethod:
    """How a linear layer stores its weight and computes y = x W^T + b. Quantized formats subclass this."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded weights (transpose, quantize, pick a kernel) once loading is complete."""

    def decode_stack_weight(self, layer: nn.Module):
        """The weight as the fused decode stack reads it (fulcrum.kernels.cpu_decode_stack): a dense tensor, a
        QuantWeight of parts, or None where the stack has no kernel for it (the layer's modules then run)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, input_size, output_sizes, dtype):
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        weight.weight_loader = layer.weight_loader
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias):
        packed = getattr(layer, "packed_weight", None)
        weight = layer.weight
        small = getattr(layer, "small_weight", None)  # fulcrum's layout for few rows where oneDNN's is the packed
        if small is not None and x.dtype == weight.dtype and cpu_prepack.small_rows(x):
            return cpu_prepack.linear(x, small, bias)
        if (
            packed is not None
            and x.dtype == weight.dtype
            and x.numel() >= cpu_prepack.min_rows(weight.dtype) * x.shape[-1]
        ):
            if cpu_prepack.is_blocked(packed) and cpu_prepack.takes_blas(x, weight):
                return torch.nn.functional.linear(x, weight, bias)
            return cpu_prepack.linear(x, packed, bias)
        return cpu_gemv.linear(x, weight, bias)

    def decode_stack_weight(self, layer):
        return layer.weight

    def process_weights_after_loading(self, layer):
        # oneDNN's blocked copy for many rows; the plain weight stays for the GEMV and the decode stack
        layer.packed_weight = cpu_prepack.pack(layer.weight)

    def pack_small(self, layer):
        """At AMX, a bf16 weight's copy in fulcrum's layout for steps of few rows (cpu_prepack.pack_small), beside
        oneDNN's: made in a pass of its own after every layer's `process_weights_after_loading`, so that where memory
        runs short the copies every step needs come first."""
        small = cpu_prepack.pack_small(layer.weight) if getattr(layer, "packed_weight", None) is not None else None
        layer.small_weight = small
