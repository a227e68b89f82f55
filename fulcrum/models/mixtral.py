"""Mixtral (MixtralForCausalLM): Llama's attention (no biases, sliding window from config.sliding_window) with a
sparse mixture-of-experts feed-forward in every layer, `block_sparse_moe`: a softmax router whose top-k weights are
renormalised to sum to 1, over num_local_experts SwiGLU experts (w1 gate, w3 up, w2 down), computed grouped. Its
own decoder layer in Llama's stack (the Qwen MoE families' base too) never allocates a dense MLP for a sparse layer.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from fulcrum.errors import ModelLoadError
from fulcrum.layers.layernorm import RMSNorm
from fulcrum.layers.moe import FusedExperts, SparseMoeBlock, TopKRouter, expert_params_mapping
from fulcrum.models.llama import LlamaAttention, LlamaForCausalLM
from fulcrum.quant import expert_format


def check_silu(cfg: PretrainedConfig) -> None:
    """The experts' activation is SiluAndMul's; refuse another rather than compute the wrong one."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported for experts (only silu)")


class MixtralDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, family: type[LlamaForCausalLM], dtype, quant):
        super().__init__()
        check_silu(cfg)
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype, quant)
        n = cfg.num_local_experts
        self.block_sparse_moe = SparseMoeBlock(
            TopKRouter(cfg.hidden_size, n, cfg.num_experts_per_tok, renormalize=True, dtype=dtype),
            FusedExperts(
                n,
                cfg.hidden_size,
                cfg.intermediate_size,
                dtype,
                expert_format(quant, f"model.layers.{layer_idx}.block_sparse_moe.experts"),
            ),  # fmt: skip
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, rope, x, meta):
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer: type[nn.Module] = MixtralDecoderLayer
    expert_names = ("w1", "w3", "w2")  # the checkpoint's gate, up and down projections of each expert

    @staticmethod
    def num_experts(cfg) -> int:
        return cfg.num_local_experts

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype | None = None, quant=None):
        super().__init__(cfg, dtype, quant)
        # the loader stacks experts.<e>.<proj> into each layer's FusedExperts through this mapping, one entry per
        # expert and projection; ahead of the dense entries, which would take an expert's gate_proj otherwise
        experts = expert_params_mapping(self.num_experts(cfg), *self.expert_names)
        self.packed_modules_mapping = {**experts, **type(self).packed_modules_mapping}
