"""RMSNorm, computed in float32 like the reference implementations, then cast back."""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.kernels import cpu_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm.usable(x, self.weight):
            return cpu_norm.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
