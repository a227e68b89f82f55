"""Attention over flattened token batches.

A batch is several sequences' tokens laid end to end ([tokens, heads, head_dim]); `AttentionMetadata`
says where each sequence starts. This reference path attends over each sequence's own tokens
(whole prompts, no cache); the paged-KV path of the engine extends the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # tokens of each sequence in this batch, in flattened order

    @classmethod
    def for_prompts(cls, lengths: list[int]) -> AttentionMetadata:
        return cls(query_lens=list(lengths))


def causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask, True where attention is allowed; queries are the last q_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for n in meta.query_lens:
            end = start + n
            out[start:end] = self._attend(q[start:end], k[start:end], v[start:end])
            start = end
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], k/v [m, KVH, D] with the queries at the last n positions."""
        n, m = q.shape[0], k.shape[0]
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        gqa = self.num_heads != self.num_kv_heads
        if self.sliding_window is None and n == m:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            mask = causal_mask(n, m, self.sliding_window, q.device)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return o.transpose(0, 1)
