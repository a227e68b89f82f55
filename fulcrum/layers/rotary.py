"""Rotary position embedding (rotate-half layout). The inverse frequencies, and the attention factor that YaRN and
LongRoPE fold into cos and sin, come from transformers' own ROPE_INIT_FUNCTIONS for every scaling type it defines,
so a scaling is computed exactly as the reference computes it."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def _rope_config(head_dim: int, max_position: int, params: dict) -> PretrainedConfig:
    """The smallest config the init functions read: one layer type's rope parameters and the sizes they scale by."""
    cfg = PretrainedConfig()
    cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads = head_dim, head_dim, 1
    cfg.max_position_embeddings = max_position
    cfg.rope_parameters = dict(params)
    return cfg


def inverse_frequencies(head_dim: int, max_position: int, params: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2], attention factor) for one table of `max_position` positions.

    `params` is a standardized rope_parameters dict (one layer type's, for models with several). The init functions
    are asked for a sequence of `max_position` tokens, which fixes the two types that depend on the length: dynamic
    NTK changes its base only beyond max_position_embeddings, which the engine never reaches, so this is its table
    for every sequence; LongRoPE takes its long factors when max_position exceeds original_max_position_embeddings.
    transformers switches LongRoPE per forward call by that call's length (and its generate() recomputes the cache
    when a sequence crosses over); a paged cache shared across requests needs one rotation per position, so the
    choice is made once per model, as vLLM makes it."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":  # the models compute it themselves in transformers; not a ROPE_INIT_FUNCTIONS entry
        base = float(params["rope_theta"])
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, attention_factor = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](
            _rope_config(head_dim, max_position, params), "cpu", seq_len=max_position
        )
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if inv_freq.numel() != head_dim // 2:
        # a partial rotary factor rotates only the head's first dimensions; apply_rotary and the CPU kernel rotate all
        raise ValueError(
            f"rope {rope_type!r} rotates {2 * inv_freq.numel()} of {head_dim} head dimensions "
            f"(partial_rotary_factor {params.get('partial_rotary_factor')}); only whole-head rotation is supported"
        )
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos and sin of every position, once per model (not per layer: at 128k positions a table is 64 MB).
    The model looks them up once per forward; each layer's attention applies them with `apply_rotary`."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(head_dim, max_position, params)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        # rotate-half negates the first half of the rotated vector: fold that sign into sin
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; rotate-half as a roll by half."""
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
