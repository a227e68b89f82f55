"""Attention over flattened token batches, with or without the paged KV cache.

A batch is several sequences' new tokens laid end to end ([tokens, heads, head_dim]); `AttentionMetadata` says
where each starts. All k/v of a layer are written to the paged cache before any attention, so a sequence may read
blocks that another sequence of the same batch is filling (a prefix-cache hit on a prompt still in flight)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels import cpu_attention, cpu_rope
from fulcrum.kernels import triton as triton_kernels
from fulcrum.layers.rotary import apply_rotary
from fulcrum.quant import kv as kv_quant
from fulcrum.quant.kv import KVFormat


class PrefillSeq(NamedTuple):
    """A sequence of a step with more than one new token, or with cached context."""

    start: int  # its first token in the step's flattened tokens
    query_len: int  # its new tokens
    context_len: int  # tokens in its cache once the step has run (the new ones included)
    row: int  # its row of AttentionMetadata.block_tables


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens of each sequence in this batch, in flattened order
    # paged-cache fields, set by the model runner; None for the reference forward
    slot_mapping: torch.Tensor | None = None  # [T] flat cache slot of every new token
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] of the prefill rows
    decode_token_idx: torch.Tensor | None = None  # [D] token positions of single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [D]
    decode_max_context: int = 0
    # the step's sequences as one varlen batch, prefill chunks and decode rows alike (set when it has prefills), for
    # kernels that take a mixed step in one call: first query row, query length, context length, block table
    seq_query_start: torch.Tensor | None = None  # [S]
    seq_query_lens: torch.Tensor | None = None  # [S]
    seq_context_lens: torch.Tensor | None = None  # [S]
    seq_block_tables: torch.Tensor | None = None  # [S, max_blocks]
    max_query_len: int = 0
    # what every layer would compute alike from the fields above (the decode mask), computed by the first
    shared: dict = field(default_factory=dict)

    @classmethod
    def for_prompts(cls, lengths: list[int]) -> AttentionMetadata:
        return cls(query_lens=list(lengths))

    @classmethod
    def for_decodes(
        cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> AttentionMetadata:
        """A step of single-token decodes only, one per block-table row: each token written to its slot, then
        attending over its sequence's first context_lens cached tokens (itself included)."""
        d = block_tables.shape[0]
        return cls(
            query_lens=[1] * d,
            slot_mapping=slot_mapping,
            decode_token_idx=torch.arange(d, device=block_tables.device),
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_max_context=int(context_lens.max()),
        )


def causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask, True where attention is allowed; queries are the last q_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


PREFILL_BLOCK = 128  # queries per block of CPU prefill attention


def attach_kv_cache(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    fmt: KVFormat | None,
    device,
    empty=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One paged cache for `layers`, each layer given its views, laid out as their class lays it out
    (`allocate_cache`: k and v per KV head here; one latent per token for multi-head latent attention).
    `empty(shape, dtype)` allocates the values zeroed (default torch.zeros on `device`)."""
    kinds = {type(layer) for layer in layers}
    if len(kinds) > 1:
        raise ValueError(f"one paged cache serves one kind of attention layer, not {sorted(k.__name__ for k in kinds)}")
    empty = empty or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
    return type(layers[0]).allocate_cache(layers, num_blocks, block_size, dtype, fmt, empty)


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Gemma 2: scores become cap * tanh(scores / cap) before the softmax. SDPA and the CPU prefill kernel cannot
        # cap, so a capped layer's prefill takes `_attend_capped` and its decode off the kernels `_attend_eager`.
        self.logit_softcap = logit_softcap
        # gpt-oss: a learned logit per query head [H] that joins each row's softmax denominator (and attends to
        # nothing), set by the model's attention module. The CPU kernels take it (else `_attend_capped` and
        # `_attend_eager` compute it); the Triton path refuses it.
        self.sinks: torch.Tensor | None = None
        self.gqa = num_heads != num_kv_heads
        # [num_blocks, block_size, kv_heads, head_dim], assigned by the model runner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # a quantized cache (--kv-cache-dtype fp8|int8): its format, and a scale per token and head
        # [num_blocks, block_size, kv_heads] fp16 for each of k and v (fulcrum.quant.kv)
        self.kv_format: KVFormat | None = None
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None

    def kv_bytes_per_token(self, dtype: torch.dtype, fmt: KVFormat | None) -> int:
        """Cache bytes one token takes in this layer: its k and v of every KV head (with their scales if quantized)."""
        return 2 * self.num_kv_heads * kv_quant.bytes_per_head(fmt, self.head_dim, dtype)

    @classmethod
    def allocate_cache(cls, layers, num_blocks, block_size, dtype, fmt, empty):
        """[2, layers, blocks, block_size, kv_heads, head_dim] of `dtype` (the format's when `fmt` quantizes it,
        with its scales [2, layers, blocks, block_size, kv_heads]); returns (cache, scales)."""
        a = layers[0]
        shape = (2, len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim)
        cache = empty(shape, dtype if fmt is None else fmt.dtype)
        scales = None if fmt is None else empty(shape[:-1], kv_quant.SCALE_DTYPE)
        for i, layer in enumerate(layers):
            layer_scales = (None, None) if scales is None else (scales[0, i], scales[1, i])
            layer.set_cache(cache[0, i], cache[1, i], fmt, *layer_scales)
        return cache, scales

    def set_cache(self, k_cache, v_cache, fmt: KVFormat | None = None, k_scales=None, v_scales=None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.kv_format, self.k_scales, self.v_scales = fmt, k_scales, v_scales

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, rope=None
    ) -> torch.Tensor:
        """q [T, H, hd], k and v [T, KVH, hd]; `rope` (cos, signed sin [T, 1, hd]) rotates q and k first. Without a
        cache (reference forward) each sequence attends over its own tokens. With the paged cache every new token's
        k/v is first written to its slot, then each sequence attends over its whole context read back through its
        block table: prefill chunks one by one (fresh prompts straight from the new k/v), decodes in one call."""
        cached = meta.slot_mapping is not None and self.k_cache is not None
        if cached and self._triton_step(q, meta):
            if self.sinks is not None:
                raise NotImplementedError(
                    "attention sinks (gpt-oss) are computed on the CPU path only; the Triton kernels do not take them"
                )
            return self._forward_triton(q, k, v, meta, rope)
        kc, vc = (self.k_cache, self.v_cache) if cached else (None, None)
        scales = (self.k_scales, self.v_scales) if cached and self.kv_format is not None else (None, None)
        if rope is not None and cpu_rope.usable(q, k, v, rope[0], rope[1], kc):
            # one kernel rotates q and k in place and writes k and v to their cache slots (quantized if it is)
            cpu_rope.rope_and_cache(q, k, v, rope[0], rope[1], meta.slot_mapping if cached else None, kc, vc, *scales)
        else:
            if rope is not None:
                q, k = apply_rotary(q, k, *rope)
            if cached:
                self._write(kc, scales[0], meta.slot_mapping, k)
                self._write(vc, scales[1], meta.slot_mapping, v)
        if not cached:
            return self._forward_no_cache(q, k, v, meta)
        if not meta.prefills and meta.decode_token_idx is not None:
            return self._decode(q, meta)  # a step of decodes only: the tokens are the decodes, in order
        out = torch.empty_like(q)
        fresh = [(start, q_len) for start, q_len, ctx_len, _ in meta.prefills if ctx_len == q_len]
        together = len(fresh) > 1 and self._kernel_prefill(q, k, v)
        if together:  # the fresh prompts (their k/v all new) in one kernel call
            cpu_attention.prefill_varlen(q, k, v, out, [(s, n, s, n) for s, n in fresh], self.scale,
                                         self.sliding_window, self.sinks)  # fmt: skip
        for start, q_len, ctx_len, row in meta.prefills:
            end = start + q_len
            if ctx_len == q_len:  # a fresh prompt: its k/v are all new
                if not together:
                    out[start:end] = self._attend(q[start:end], k[start:end], v[start:end])
            else:
                ks, vs = self._gather(meta.block_tables[row], ctx_len, q.dtype)
                out[start:end] = self._attend(q[start:end], ks, vs)
        if meta.decode_token_idx is not None:
            out[meta.decode_token_idx] = self._decode(q[meta.decode_token_idx], meta)
        return out

    def _triton_step(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The Triton kernels take the step (on CUDA, or forced on CPU): a decode-only step, or one whose sequences
        the model runner laid out as a varlen batch."""
        decode_only = not meta.prefills and meta.decode_token_idx is not None
        return (decode_only or meta.seq_query_start is not None) and triton_kernels.usable(q)

    def _forward_triton(self, q, k, v, meta: AttentionMetadata, rope) -> torch.Tensor:
        """Rotary and the cache write in one kernel, then one attention kernel over the paged cache for the whole
        step: decode rows only (split over the context for long ones), or a mixed step as one varlen batch."""
        from fulcrum.kernels.triton import decode_attention, prefill_attention, rope_cache

        cos, sin = rope if rope is not None else (None, None)
        kc, vc, ks, vs = self.k_cache, self.v_cache, self.k_scales, self.v_scales
        rope_cache.rope_and_cache(q, k, v, cos, sin, meta.slot_mapping, kc, vc, ks, vs)
        opts = dict(sliding_window=self.sliding_window, softcap=self.logit_softcap, k_scales=ks, v_scales=vs)
        if not meta.prefills:
            return decode_attention.paged_decode(
                q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, self.scale, **opts
            )
        return prefill_attention.paged_prefill(
            q, kc, vc, meta.seq_query_start, meta.seq_query_lens, meta.seq_context_lens, meta.seq_block_tables,
            self.scale, meta.max_query_len, out=torch.empty_like(q), **opts,
        )  # fmt: skip

    def _forward_no_cache(self, q, k, v, meta):
        out = torch.empty_like(q)
        spans, start = [], 0
        for n in meta.query_lens:
            spans.append((start, n, start, n))
            start += n
        if len(spans) > 1 and self._kernel_prefill(q, k, v):
            cpu_attention.prefill_varlen(q, k, v, out, spans, self.scale, self.sliding_window, self.sinks)
            return out
        for start, n, _, _ in spans:
            out[start : start + n] = self._attend(q[start : start + n], k[start : start + n], v[start : start + n])
        return out

    def _kernel_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """The CPU prefill kernel takes this layer's fresh prompts (what `_attend` would give them, uncapped)."""
        return self.logit_softcap is None and cpu_attention.prefill_usable(q, k, v)

    def _write(self, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Tokens' k or v [T, KVH, hd] into their cache slots, quantized where the cache is."""
        if scales is None:
            cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, x.to(cache.dtype))
            return
        qx, sx = kv_quant.quantize(x, self.kv_format)
        # as bytes: index_copy_ has no fp8 kernel on CPU
        cache.view(torch.uint8).view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, qx.view(torch.uint8))
        scales.view(-1, self.num_kv_heads).index_copy_(0, slots, sx)

    def _read(self, cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, dtype) -> torch.Tensor:
        """The cached k or v of `blocks` (any shape of block ids): [*blocks.shape, block_size, KVH, hd]."""
        if scales is None:
            return cache[blocks]
        return kv_quant.dequantize(cache[blocks], scales[blocks], dtype)

    def _gather(self, block_table: torch.Tensor, ctx_len: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.k_cache.shape[1]
        blocks = block_table[: -(-ctx_len // bs)]
        ks = self._read(self.k_cache, self.k_scales, blocks, dtype).flatten(0, 1)[:ctx_len]
        vs = self._read(self.v_cache, self.v_scales, blocks, dtype).flatten(0, 1)[:ctx_len]
        return ks, vs

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], k/v [m, KVH, D] with the queries at the last n positions."""
        n, m = q.shape[0], k.shape[0]
        if self._kernel_prefill(q, k, v):  # flash-style, no score matrix
            return cpu_attention.prefill(q, k, v, self.scale, self.sliding_window, self.sinks)
        if self.logit_softcap is not None or self.sinks is not None:
            return self._attend_capped(q, k, v)
        if q.device.type == "cpu" and n >= 64 and self.sliding_window is None:
            return self._attend_blocked(q, k, v)
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if self.sliding_window is None and n == m:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=self.gqa)
        else:
            mask = causal_mask(n, m, self.sliding_window, q.device)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa)
        return o.transpose(0, 1)

    def _attend_capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Soft-capped (or sink) causal attention, PREFILL_BLOCK queries at a time against only the keys they can see (those
        of their window), so that the scores of a long prompt are never held whole."""
        n, m = q.shape[0], k.shape[0]
        out = torch.empty_like(q)
        for s in range(0, n, PREFILL_BLOCK):
            e = min(n, s + PREFILL_BLOCK)
            hi = m - n + e  # keys up to the block's last query
            lo = 0 if self.sliding_window is None else max(0, m - n + s - self.sliding_window + 1)
            mask = causal_mask(e - s, hi - lo, self.sliding_window, q.device)
            kt, vt = k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1)
            out[s:e] = self._attend_eager(q[s:e].transpose(0, 1), kt, vt, mask).transpose(0, 1)
        return out

    def _attend_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Soft-capped attention as transformers' eager path computes it: q [..., H, n, hd], k/v [..., KVH, m, hd],
        `mask` (True where allowed) broadcast to the scores [..., H, n, m]; scores and softmax in float32. With
        sinks each head's sink logit joins its rows' softmax as one more column, dropped after it."""
        g = self.num_heads // self.num_kv_heads
        *lead, _, n, d = q.shape
        qg = q.float().reshape(*lead, self.num_kv_heads, g * n, d)  # a KV head's query heads as its rows
        scores = torch.matmul(qg, k.float().transpose(-1, -2)).view(*lead, self.num_heads, n, -1) * self.scale
        if self.logit_softcap is not None:
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = self.sinks.float().view(self.num_heads, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        probs = probs.reshape(*lead, self.num_kv_heads, g * n, -1)
        return torch.matmul(probs, v.float()).view(*lead, self.num_heads, n, d).to(q.dtype)

    def _attend_blocked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention on CPU as batched matmuls over blocks of PREFILL_BLOCK queries, each against only the
        keys it can see, in float32. A block's query heads that share a KV head are stacked into one matmul, the
        scale is folded into the queries, and only the block's last PREFILL_BLOCK keys need the causal mask. It beat
        both one matmul over the whole n x m square (half of it masked away) and PyTorch's SDPA for long prompts on
        AVX2, in fp32 and in bf16 (whose matmuls have no fast path without native bf16: the inputs are widened once)."""
        n, m = q.shape[0], k.shape[0]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        past = m - n  # cached tokens before the first query
        qh = (q.float() * self.scale).transpose(0, 1).reshape(kvh, g, n, d)
        kt, vt = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [kvh, m, d]
        out = torch.empty(n, self.num_heads, d, dtype=q.dtype, device=q.device)
        for s in range(0, n, PREFILL_BLOCK):
            e = min(n, s + PREFILL_BLOCK)
            seen = past + e  # keys up to the block's last query
            qg = qh[:, :, s:e].reshape(kvh, g * (e - s), d)
            scores = torch.matmul(qg, kt[:, :seen].transpose(1, 2)).view(kvh, g, e - s, seen)
            scores[..., past + s : seen].masked_fill_(~causal_mask(e - s, e - s, None, q.device), float("-inf"))
            probs = scores.softmax(-1).view(kvh, g * (e - s), seen)
            o = torch.matmul(probs, vt[:, :seen])  # [kvh, g * block, d]
            out[s:e] = o.view(kvh, g, e - s, d).permute(2, 0, 1, 3).reshape(e - s, self.num_heads, d)
        return out

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query token per sequence, all sequences in one call: q [D, H, hd]."""
        if cpu_attention.usable(q, self.k_cache, self.num_kv_heads):
            return cpu_attention.decode(
                q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, self.sliding_window, self.k_scales, self.v_scales, self.logit_softcap, self.sinks,
            )  # fmt: skip
        bs = self.k_cache.shape[1]
        nblocks = -(-meta.decode_max_context // bs)
        bt = meta.decode_block_tables[:, :nblocks]
        ks = self._read(self.k_cache, self.k_scales, bt, q.dtype).flatten(1, 2).transpose(1, 2)  # [D, KVH, L, hd]
        vs = self._read(self.v_cache, self.v_scales, bt, q.dtype).flatten(1, 2).transpose(1, 2)
        key = ("decode_mask", self.sliding_window)
        if (mask := meta.shared.get(key)) is None:
            pos = torch.arange(ks.shape[2], device=q.device)
            ctx = meta.decode_context_lens.unsqueeze(1)
            mask = pos < ctx
            if self.sliding_window is not None:
                mask &= pos >= ctx - self.sliding_window
            mask = meta.shared[key] = mask[:, None, None, :]
        if self.logit_softcap is not None or self.sinks is not None:
            return self._attend_eager(q.unsqueeze(2), ks, vs, mask).squeeze(2)
        if self.gqa and q.dtype != torch.float32:
            # The query heads that share a KV head become that head's "query rows": one grouped call that
            # reads each KV head once, where enable_gqa on CPU in 16 bits expands K and V to every query head.
            n, g = q.shape[0], self.num_heads // self.num_kv_heads
            qg = q.view(n, self.num_kv_heads, g, self.head_dim)
            o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=mask, scale=self.scale)
            return o.reshape(n, self.num_heads, self.head_dim)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa
        )
        return o.squeeze(2)
