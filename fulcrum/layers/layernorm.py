"""RMSNorm, computed in float32 like the reference implementations, then cast back; and Gemma's, which scales by
(1 + weight) in float32 before the cast."""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.kernels import cpu_norm
from fulcrum.kernels import triton as triton_kernels
from fulcrum.layers.linear import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm.usable(x, self.weight):
            return cpu_norm.rms_norm(x, self.weight, self.eps)
        if triton_kernels.usable(x) and x.dim() == 2:
            from fulcrum.kernels.triton import rms_norm

            return rms_norm.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w and the norm scales by (1 + w), in float32, rounding once at the
    end (Llama's rounds the normalized x first, then multiplies in the model's dtype). The parameter holds (1 + w)
    in float32, added once at load time, so a float32 model takes the CPU kernel unchanged (`dtype`, the model's,
    is taken for RMSNorm's signature and not used)."""

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, 1.0 + loaded.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm.usable(x, self.weight):
            return cpu_norm.rms_norm(x, self.weight, self.eps)  # float32 input: the same arithmetic in one pass
        if triton_kernels.usable(x) and x.dim() == 2:
            from fulcrum.kernels.triton import rms_norm

            return rms_norm.rms_norm(x, self.weight, self.eps, gemma=True)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
