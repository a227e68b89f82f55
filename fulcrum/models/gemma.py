"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP with Gemma's changes: embeddings scaled by
sqrt(hidden_size); RMSNorm by (1 + w); a norm after attention and after the MLP as well as before each; GELU (tanh) in
the gate; the attention scale from query_pre_attn_scalar; sliding and global layers as config.layer_types lays them
out; final logits soft-capped. Gemma 2 soft-caps the attention scores too; Gemma 3 adds per-head q/k norms and gives
its sliding layers a rope of their own (rope_parameters by layer type)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from fulcrum.config import rope_parameters
from fulcrum.errors import ModelLoadError
from fulcrum.layers.layernorm import GemmaRMSNorm
from fulcrum.layers.rotary import RotaryEmbedding
from fulcrum.model_folder.hf_config import head_dim as config_head_dim
from fulcrum.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

SLIDING, FULL = "sliding_attention", "full_attention"


class GeluAndMul(nn.Module):
    """[gate, up] -> act(gate) * up, with the activation transformers names in config.hidden_activation."""

    def __init__(self, name: str):
        super().__init__()
        if name not in ACT2FN:
            raise ModelLoadError(f"hidden_activation {name!r} is not an activation transformers defines")
        self.act = ACT2FN[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return self.act(gate) * up


def layer_rope_parameters(cfg: PretrainedConfig, layer_type: str) -> dict:
    """One layer type's rope settings: Gemma 3 keeps one dict per layer type (its sliding layers' base is
    rope_local_base_freq), Gemma 2 one for all."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params:
        return dict(params[layer_type])
    return rope_parameters(cfg)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, family: type[Gemma2ForCausalLM], dtype, quant):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = LlamaAttention(
            cfg, layer_idx, dtype, quant, qkv_bias=bias, o_bias=bias, qk_norm=family.qk_norm,
            scale=cfg.query_pre_attn_scalar**-0.5,
            logit_softcap=family.attn_logit_softcap(cfg), norm=GemmaRMSNorm,
        )  # fmt: skip
        act = GeluAndMul(cfg.hidden_activation)
        self.mlp = LlamaMLP(cfg, False, dtype, quant, f"model.layers.{layer_idx}.mlp", act=act)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, ropes, x, meta):
        rope = ropes[self.layer_type]
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    """Llama's stack with the embedding scaled by sqrt(hidden) and a second rope table for the sliding layers when
    their settings differ (each layer picks its table by type)."""

    def __init__(self, cfg: PretrainedConfig, family: type[Gemma2ForCausalLM], dtype, quant):
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ModelLoadError("use_bidirectional_attention (an embedding model's attention) is not supported")
        super().__init__(cfg, family, dtype, quant)
        # transformers rounds sqrt(hidden) to the model's dtype (55.4256 becomes 55.5 in bf16 for 3072)
        self.normalizer = cfg.hidden_size**0.5
        # `rotary_emb` (the name every family uses) serves the global layers, and the sliding ones unless they differ
        local = layer_rope_parameters(cfg, SLIDING)
        self.rotary_emb_local = None
        if SLIDING in cfg.layer_types and local != layer_rope_parameters(cfg, FULL):
            self.rotary_emb_local = RotaryEmbedding(config_head_dim(cfg), cfg.max_position_embeddings, local)

    def embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.normalizer, dtype=x.dtype, device=x.device)

    def ropes(self, positions, dtype):
        ropes = {FULL: self.rotary_emb(positions, dtype)}  # one lookup per table for all layers
        local = self.rotary_emb_local
        ropes[SLIDING] = ropes[FULL] if local is None else local(positions, dtype)
        return ropes


class Gemma2ForCausalLM(LlamaForCausalLM):
    base_model_class = GemmaModel
    decoder_layer = GemmaDecoderLayer

    @staticmethod
    def final_norm(cfg, dtype) -> nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def rotary(cfg) -> nn.Module:
        return RotaryEmbedding(config_head_dim(cfg), cfg.max_position_embeddings, layer_rope_parameters(cfg, FULL))

    @staticmethod
    def attn_logit_softcap(cfg) -> float | None:
        return getattr(cfg, "attn_logit_softcapping", None)

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype | None = None, quant=None):
        super().__init__(cfg, dtype, quant)
        self.final_logit_softcap = getattr(cfg, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    @staticmethod
    def attn_logit_softcap(cfg) -> float | None:
        # Gemma 3 configs carry attn_logit_softcapping (None in every released checkpoint), but transformers'
        # Gemma3Attention never applies it: neither do we, so that a config which sets it still matches
        return None
