"""SwiGLU's gate: the input holds [gate, up] stacked on the last dimension."""

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels import cpu_act


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_act.usable(x):
            return cpu_act.silu_and_mul(x)  # one pass on CPU
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
