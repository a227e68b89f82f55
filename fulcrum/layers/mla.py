"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache. A token's cache row is its compressed latent
and its rotated RoPE key, kv_lora_rank + qk_rope_head_dim values shared by every head (576 for V3), not k and v.
Prefill expands keys and values from the latents; decode absorbs kv_b_proj's weights into the query instead, so that
a step reads each cached row once (`_decode`; measured: benchmarks/results/cpu-mla.log).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.errors import InvalidRequestError
from fulcrum.kernels import triton as triton_kernels
from fulcrum.layers.attention import Attention, AttentionMetadata, causal_mask
from fulcrum.quant.kv import KVFormat


def _refuse_quantized(fmt: KVFormat | None) -> None:
    if fmt is not None:
        raise InvalidRequestError(
            f"--kv-cache-dtype {fmt.name} is not supported for multi-head latent attention (DeepSeek-V2/V3): its "
            "cache holds one compressed latent per token, which fulcrum does not quantize; use --kv-cache-dtype auto",
            param="kv_cache_dtype",
        )


class MLAAttention(Attention):
    """Absorbed, MLA is multi-query attention with one KV head as wide as a cache row: the row is the key and its
    first kv_lora_rank values the value. Hence Attention's num_kv_heads 1 and head_dim kv_lora_rank +
    qk_rope_head_dim, which is what a cache row holds; `kv_bytes_per_token` and `allocate_cache` say so to the
    model runner, so the engine allocates exactly the rows (what `fulcrum plan` counts for MLA)."""

    def __init__(
        self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
        scale: float,
    ):  # fmt: skip
        super().__init__(num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale)
        self.kv_lora_rank, self.qk_nope_head_dim = kv_lora_rank, qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = qk_rope_head_dim, v_head_dim
        # decode through the absorbed weights; False expands K/V from the cached latents every step instead
        # (the same result: the baseline benchmarks/bench_mla.py measures it against)
        self.absorb = True
        # kv_b_proj's weights per head, set by `load_up_projection` once the checkpoint is loaded
        self.register_buffer("w_uk", None, persistent=False)  # [heads, qk_nope_head_dim, kv_lora_rank]
        self.register_buffer("w_uv", None, persistent=False)  # [heads, v_head_dim, kv_lora_rank]

    # -- the cache: one row of kv_lora_rank + qk_rope_head_dim per token ----------------------------------------

    def kv_bytes_per_token(self, dtype: torch.dtype, fmt: KVFormat | None) -> int:
        _refuse_quantized(fmt)
        return self.head_dim * dtype.itemsize

    @classmethod
    def allocate_cache(cls, layers, num_blocks, block_size, dtype, fmt, empty):
        """[layers, blocks, block_size, kv_lora_rank + qk_rope_head_dim]; returns (cache, None)."""
        _refuse_quantized(fmt)
        cache = empty((len(layers), num_blocks, block_size, layers[0].head_dim), dtype)
        for i, layer in enumerate(layers):
            layer.set_cache(cache[i])
        return cache, None

    def set_cache(self, k_cache, v_cache=None, fmt: KVFormat | None = None, k_scales=None, v_scales=None) -> None:
        """`k_cache` [blocks, block_size, row]; the value cache is a view of its latents (`v_cache` is not used)."""
        _refuse_quantized(fmt)
        self.k_cache = k_cache
        self.v_cache = None if k_cache is None else k_cache[..., : self.kv_lora_rank]

    def load_up_projection(self, kv_b_proj: nn.Module, dtype: torch.dtype) -> None:
        """W_UK and W_UV from kv_b_proj ([heads * (qk_nope + v), kv_lora_rank], heads outermost), read by running
        the layer on the identity: a quantized kv_b_proj gives the weights its own matmul uses."""
        device = next(itertools.chain(kv_b_proj.parameters(), kv_b_proj.buffers())).device  # quantized: buffers
        with torch.no_grad():
            w = kv_b_proj(torch.eye(self.kv_lora_rank, dtype=dtype, device=device)).T
        w = w.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.qk_nope_head_dim].contiguous()
        self.w_uv = w[:, self.qk_nope_head_dim :].contiguous()

    # -- attention --------------------------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, qk_nope + qk_rope] and kv [T, kv_lora_rank + qk_rope] (each token's normed latent and its RoPE
        key, what the cache keeps), RoPE applied to both; returns [T, H, v_head_dim]."""
        if self.w_uk is None:
            raise RuntimeError("MLAAttention used before load_up_projection (the model's after_loading) ran")
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        if meta.slot_mapping is None or self.k_cache is None:  # the reference forward: each prompt on its own
            start = 0
            for n in meta.query_lens:
                out[start : start + n] = self._attend_expanded(q[start : start + n], kv[start : start + n])
                start += n
            return out
        self.k_cache.view(-1, self.head_dim).index_copy_(0, meta.slot_mapping, kv.to(self.k_cache.dtype))
        if not meta.prefills and meta.decode_token_idx is not None:
            return self._decode(q, meta)  # a step of decodes only: the tokens are the decodes, in order
        for start, q_len, ctx_len, row in meta.prefills:
            end = start + q_len
            if ctx_len == q_len:  # a fresh prompt: its rows are all new
                out[start:end] = self._attend_expanded(q[start:end], kv[start:end])
            else:
                out[start:end] = self._attend_expanded(q[start:end], self._rows(meta.block_tables[row], ctx_len, q))
        if meta.decode_token_idx is not None:
            out[meta.decode_token_idx] = self._decode(q[meta.decode_token_idx], meta)
        return out

    def _rows(self, block_table: torch.Tensor, ctx_len: int, q: torch.Tensor) -> torch.Tensor:
        """A sequence's first ctx_len cache rows [ctx_len, row]."""
        blocks = block_table[: -(-ctx_len // self.k_cache.shape[1])]
        return self.k_cache[blocks].flatten(0, 1)[:ctx_len].to(q.dtype)

    def _expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [..., m, row] to keys [..., H, m, qk_nope + qk_rope] and values [..., H, m, v]."""
        latent, k_pe = rows.unsqueeze(-3).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        k_nope = torch.matmul(latent, self.w_uk.transpose(1, 2))
        v = torch.matmul(latent, self.w_uv.transpose(1, 2))
        return torch.cat((k_nope, k_pe.expand(*k_nope.shape[:-1], -1)), -1), v

    def _attend_expanded(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Causal multi-head attention of q [n, H, qk] over keys and values expanded from rows [m, row], the
        queries at the last n positions."""
        n, m = q.shape[0], rows.shape[0]
        k, v = self._expand(rows)
        qt = q.transpose(0, 1)
        if n == m:
            o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qt, k, v, attn_mask=causal_mask(n, m, None, q.device), scale=self.scale)
        return o.transpose(0, 1)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query token per sequence, all sequences in one call: q [D, H, qk] -> [D, H, v]. Absorbed (DeepSeek-V2,
        section 2.1.3): the query's no-RoPE part goes through W_UK into the latent space, so a score is
        q_lat . c + q_pe . k_pe against the cached rows as they are, and the attended latent goes through W_UV on the
        way out. A step then reads each cached row once, where expanding (as prefill does, `_expand`) would rebuild
        [context, heads, qk + v] keys and values every step."""
        if self.absorb and triton_kernels.usable(q):
            return self._decode_triton(q, meta)
        bs = self.k_cache.shape[1]
        nblocks = -(-meta.decode_max_context // bs)
        rows = self.k_cache[meta.decode_block_tables[:, :nblocks]].flatten(1, 2).to(q.dtype)  # [D, L, row]
        if (mask := meta.shared.get("mla_decode_mask")) is None:
            pos = torch.arange(rows.shape[1], device=q.device)
            mask = meta.shared["mla_decode_mask"] = (pos < meta.decode_context_lens.unsqueeze(1))[:, None, None, :]
        if not self.absorb:
            k, v = self._expand(rows)  # [D, H, L, *]
            return self._attend_rows(q.unsqueeze(2), k, v, mask).squeeze(2)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        q_lat = torch.matmul(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [D, H, kv_lora_rank]
        # the heads are the query rows of one KV head: [D, 1, H, row] against [D, 1, L, row]
        qf = torch.cat((q_lat, q_pe), -1).unsqueeze(1)
        o_lat = self._attend_rows(qf, rows.unsqueeze(1), rows[..., : self.kv_lora_rank].unsqueeze(1), mask)
        return torch.matmul(o_lat.squeeze(1).transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def _decode_triton(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The absorbed decode through the paged decode kernel, reading the cache rows where they lie: one KV head
        (the row) whose values are the row's first kv_lora_rank entries, every query head in its group."""
        from fulcrum.kernels.triton import decode_attention

        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        q_lat = torch.matmul(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [D, H, kv_lora_rank]
        rows = self.k_cache.unsqueeze(2)  # [blocks, block_size, 1, row]
        o_lat = decode_attention.paged_decode(
            torch.cat((q_lat, q_pe), -1).contiguous(), rows, rows[..., : self.kv_lora_rank],
            meta.decode_block_tables, meta.decode_context_lens, self.scale,
        )  # fmt: skip
        return torch.matmul(o_lat.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale) v with the scores' softmax in float32, where `mask` (True where allowed) is False
        past each context. Two matmuls rather than SDPA, whose CPU paths were slower for these shapes (a few
        sequences, tens of query rows, about a thousand cached rows), bf16 most of all."""
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1).to(v.dtype)
        return torch.matmul(probs, v)
