"""Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2's and Qwen3's attention with a sparse
`mlp` on the layers decoder_sparse_step and mlp_only_layers choose (the others keep a dense MLP of
intermediate_size). The router is a softmax over num_experts; its top-k weights are renormalised only when
norm_topk_prob (false in Qwen2-MoE's releases, true in Qwen3-MoE's). Qwen2-MoE adds a shared expert that every
token runs, scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PretrainedConfig

from fulcrum.layers.layernorm import RMSNorm
from fulcrum.layers.moe import FusedExperts, SparseMoeBlock, TopKRouter
from fulcrum.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from fulcrum.models.mixtral import MixtralForCausalLM, check_silu
from fulcrum.quant import expert_format


def is_sparse_layer(cfg: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' rule for which layers hold experts."""
    step = getattr(cfg, "decoder_sparse_step", 1)
    return (
        layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


def with_intermediate_size(cfg: PretrainedConfig, size: int) -> PretrainedConfig:
    """A copy of cfg whose intermediate_size is `size`: LlamaMLP takes its width from the config, and the shared
    expert's is shared_expert_intermediate_size."""
    out = copy.copy(cfg)
    out.intermediate_size = size
    return out


class QwenMoeDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, family: type[LlamaForCausalLM], dtype, quant):
        super().__init__()
        check_silu(cfg)
        self.self_attn = LlamaAttention.of_family(cfg, layer_idx, family, dtype, quant)
        prefix = f"model.layers.{layer_idx}.mlp"
        if is_sparse_layer(cfg, layer_idx):
            n, shared_size = cfg.num_experts, getattr(cfg, "shared_expert_intermediate_size", 0) or 0
            shared = None
            if shared_size:
                shared_cfg = with_intermediate_size(cfg, shared_size)
                shared = LlamaMLP(shared_cfg, False, dtype, quant, f"{prefix}.shared_expert")
            self.mlp = SparseMoeBlock(
                TopKRouter(cfg.hidden_size, n, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob, dtype=dtype),
                FusedExperts(
                    n, cfg.hidden_size, cfg.moe_intermediate_size, dtype, expert_format(quant, f"{prefix}.experts")
                ),
                shared_expert=shared,
                shared_expert_name="shared_expert",
                shared_expert_gate=shared is not None,
                dtype=dtype,
            )
        else:
            self.mlp = LlamaMLP(cfg, False, dtype, quant, prefix)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, rope, x, meta):
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    decoder_layer = QwenMoeDecoderLayer
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def num_experts(cfg) -> int:
        return cfg.num_experts

    @staticmethod
    def qkv_bias(cfg) -> bool:
        return bool(getattr(cfg, "qkv_bias", True))  # a config switch since transformers 5; always on before

    @staticmethod
    def o_bias(cfg) -> bool:
        return False


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    # Qwen3's attention: attention_bias for all four projections (false in every release)
    qkv_bias = staticmethod(LlamaForCausalLM.qkv_bias)
    o_bias = staticmethod(LlamaForCausalLM.o_bias)
