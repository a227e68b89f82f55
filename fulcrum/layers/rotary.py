"""Rotary position embedding (rotate-half layout), with Llama 3 and linear frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    rope_type = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_scale(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of every position, once per model (not per layer: at 128k positions a table is 64 MB).
    The model looks them up once per forward; each layer's attention applies them with `apply_rotary`."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        # rotate-half negates the first half of the rotated vector: fold that sign into sin
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin() * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; rotate-half as a roll by half."""
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
