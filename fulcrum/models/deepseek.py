"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention in every layer
(fulcrum.layers.mla), Llama's SwiGLU MLP in the first first_k_dense_replace layers and a mixture of experts after
(fulcrum.layers.moe: n_routed_experts grouped, n_shared_experts always on as one MLP of their summed width; V2's
softmax router, greedy or group-limited; V3's sigmoid router with its score-correction bias and grouped top-k).
RoPE touches only the qk_rope_head_dim part of each head, its dimensions in interleaved pairs (`rotate_pairs`)."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from fulcrum.config import rope_parameters
from fulcrum.errors import ModelLoadError
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.layers.layernorm import RMSNorm
from fulcrum.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from fulcrum.layers.mla import MLAAttention
from fulcrum.layers.moe import FusedExperts, SparseMoeBlock, TopKRouter, expert_params_mapping
from fulcrum.layers.rotary import RotaryEmbedding, apply_rotary
from fulcrum.models.llama import LlamaForCausalLM, LlamaMLP
from fulcrum.models.mixtral import check_silu
from fulcrum.models.qwen_moe import with_intermediate_size
from fulcrum.quant import expert_format

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: PretrainedConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when the rope is scaled and the
    config gives mscale_all_dim (transformers' yarn_apply_mscale): the longer context's logits are scaled up. That
    is on top of YaRN's attention factor, which scales cos and sin."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3) ... from the rotate-half tables (cos and signed sin, whose
    first half holds each pair's angle), the result de-interleaved (evens, then odds) as transformers' V3 returns
    it. q and k come out permuted alike, so their dot products are the interleaved rotation's. The checkpoints lay
    the RoPE dimensions out in pairs: V2 always, V3 unless rope_interleave is false."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., half:]  # sin's second half carries the + sign
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


class DeepseekAttention(nn.Module):
    """The projections around MLAAttention, under the checkpoint's names: the queries from a low-rank q_a/q_b pair,
    or V2-Lite's plain q_proj; the keys and values from one compressed latent (kv_a_proj_with_mqa). q_a_proj and
    kv_a_proj_with_mqa are replicated across tensor-parallel ranks (LinearBase: no split), as is the latent cache;
    the heads split."""

    def __init__(self, cfg: PretrainedConfig, layer_idx: int, interleaved: bool, dtype, quant):
        super().__init__()
        prefix = f"model.layers.{layer_idx}.self_attn"
        heads, hidden, bias = cfg.num_attention_heads, cfg.hidden_size, bool(cfg.attention_bias)
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, dtype=dtype, quant_method=quant(f"{prefix}.q_proj"))
        else:
            self.q_a_proj = LinearBase(
                hidden, [self.q_lora_rank], bias=bias, dtype=dtype, quant_method=quant(f"{prefix}.q_a_proj")
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, heads * qk, dtype=dtype, quant_method=quant(f"{prefix}.q_b_proj")
            )
        self.kv_a_proj_with_mqa = LinearBase(
            hidden, [self.kv_lora_rank + self.rope_dim], bias=bias, dtype=dtype,
            quant_method=quant(f"{prefix}.kv_a_proj_with_mqa"),
        )  # fmt: skip
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.nope + self.v_dim), dtype=dtype, quant_method=quant(f"{prefix}.kv_b_proj")
        )
        self.o_proj = RowParallelLinear(
            heads * self.v_dim, hidden, bias=bias, dtype=dtype, quant_method=quant(f"{prefix}.o_proj")
        )
        self.num_heads = self.o_proj.input_size // self.v_dim  # this rank's heads
        self.dtype = dtype or torch.get_default_dtype()
        self.interleaved = interleaved
        self.attn = MLAAttention(
            self.num_heads, self.kv_lora_rank, self.nope, self.rope_dim, self.v_dim, softmax_scale(cfg)
        )

    def after_loading(self) -> None:
        """kv_b_proj's weights move into the attention as W_UK and W_UV (prefill expands with them, decode absorbs
        them); the projection itself is dropped, so its weights are held once."""
        self.attn.load_up_projection(self.kv_b_proj, self.dtype)
        del self.kv_b_proj

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata):
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.unsqueeze(1)  # the one RoPE key all heads share, [T, 1, rope]
        if self.interleaved:
            q_pe, k_pe = rotate_pairs(q_pe, *rope), rotate_pairs(k_pe, *rope)
        else:
            q_pe, k_pe = apply_rotary(q_pe, k_pe, *rope)
        o = self.attn(torch.cat((q_nope, q_pe), -1), torch.cat((latent, k_pe.squeeze(1)), -1), meta)
        return self.o_proj(o.reshape(-1, self.num_heads * self.v_dim))


def dense_layers(cfg: PretrainedConfig) -> int:
    """How many leading layers have a dense MLP (the rest have experts)."""
    return min(cfg.num_hidden_layers, cfg.first_k_dense_replace or 0)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, family: type[DeepseekV2ForCausalLM], dtype, quant):
        super().__init__()
        self.self_attn = DeepseekAttention(cfg, layer_idx, family.rope_interleaved(cfg), dtype, quant)
        prefix = f"model.layers.{layer_idx}.mlp"
        bias = bool(getattr(cfg, "mlp_bias", False))  # V2's; V3 has none
        if layer_idx < dense_layers(cfg):
            self.mlp = LlamaMLP(cfg, bias, dtype, quant, prefix)
        else:
            check_silu(cfg)
            n, shared = cfg.n_routed_experts, None
            if cfg.n_shared_experts:
                shared_cfg = with_intermediate_size(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
                shared = LlamaMLP(shared_cfg, bias, dtype, quant, f"{prefix}.shared_experts")
            self.mlp = SparseMoeBlock(
                family.router(cfg, dtype),
                FusedExperts(
                    n, cfg.hidden_size, cfg.moe_intermediate_size, dtype, expert_format(quant, f"{prefix}.experts")
                ),
                shared_expert=shared,
                shared_expert_name="shared_experts",
            )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, rope, x, meta):
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # the MLP's gate and up stack as Llama's; the attention's projections load under their own names
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    decoder_layer = DeepseekDecoderLayer

    @staticmethod
    def rotary(cfg) -> nn.Module:
        # the table covers the RoPE part of a head only
        return RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, rope_parameters(cfg))

    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return True  # V2 rotates complex pairs

    @staticmethod
    def router(cfg, dtype) -> TopKRouter:
        """Softmax over the experts in float32, scaled by routed_scaling_factor and never renormalised (transformers'
        V2 router reads no norm_topk_prob); group_limited_greedy keeps the topk_group groups of best expert."""
        grouped = cfg.topk_method == "group_limited_greedy"
        if cfg.topk_method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(f"topk_method {cfg.topk_method!r} is not DeepSeek-V2's (greedy, group_limited_greedy)")
        return TopKRouter(
            cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, scoring="softmax",
            n_group=cfg.n_group if grouped else None, topk_group=cfg.topk_group if grouped else None,
            routed_scaling_factor=cfg.routed_scaling_factor, logits_fp32=True, dtype=dtype,
        )  # fmt: skip

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype | None = None, quant=None):
        super().__init__(cfg, dtype, quant)
        # each expert's checkpoint tensors stack into its layer's FusedExperts; these entries go first, since an
        # expert's gate_proj would match the dense one
        experts = expert_params_mapping(cfg.n_routed_experts or 0, "gate_proj", "up_proj", "down_proj")
        self.packed_modules_mapping = {**experts, **type(self).packed_modules_mapping}

    def after_loading(self) -> None:
        super().after_loading()
        for layer in self.model.local_layers():
            layer.self_attn.after_loading()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def skip_weight(self, name: str) -> bool:
        """V3 checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the last one
        (model.layers.61.* in DeepSeek-V3), used only to draft for speculative decoding: not loaded, as vLLM's
        main model does not."""
        if super().skip_weight(name):
            return True  # another pipeline stage's
        if not name.startswith("model.layers."):
            return False
        index = name.split(".")[2]
        return index.isdigit() and int(index) >= len(self.model.layers)

    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return bool(getattr(cfg, "rope_interleave", True))

    @staticmethod
    def router(cfg, dtype) -> TopKRouter:
        """Sigmoid scores in float32; e_score_correction_bias added for choosing only; the topk_group groups of best
        two (biased) scores kept; the chosen unbiased scores renormalised when norm_topk_prob, then scaled by
        routed_scaling_factor (transformers' V3 router, whatever topk_method says)."""
        return TopKRouter(
            cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, scoring="sigmoid",
            renormalize=bool(cfg.norm_topk_prob), n_group=cfg.n_group, topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor, correction_bias=True, logits_fp32=True, dtype=dtype,
        )  # fmt: skip
