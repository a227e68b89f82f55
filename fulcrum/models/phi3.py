"""Phi-3 (Phi3ForCausalLM): Llama's layers, with q/k/v and gate/up already fused in the checkpoint (qkv_proj,
gate_up_proj), and LongRoPE scaling (rope_type longrope; configs of the first releases say su), whose frequencies
fulcrum.layers.rotary takes from transformers."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from fulcrum.errors import WeightShapeError
from fulcrum.layers.linear import MergedColumnParallelLinear
from fulcrum.model_folder.hf_config import head_dim as config_head_dim
from fulcrum.models.llama import LlamaForCausalLM


def load_fused(layer: MergedColumnParallelLinear, shard_ids: list, sizes: list[int]) -> None:
    """Make `layer`'s stacked parameters take the checkpoint's fused tensor: it is cut into its shards (full sizes
    `sizes`, stacked on dim 0) and each is loaded as a separate q/k/v or gate/up tensor would be, so that every
    tensor-parallel rank takes its own slice of each shard rather than a slice of the fused rows."""
    for param in layer.parameters(recurse=False):
        if getattr(param, "weight_loader", None) != layer.weight_loader:
            continue  # a quantized format's own tensors keep their loaders

        def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if shard_id is not None:
                return layer.weight_loader(param, loaded, shard_id)
            if loaded.shape[0] != sum(sizes):
                raise WeightShapeError((sum(sizes), *loaded.shape[1:]), loaded.shape)
            for shard, part in zip(shard_ids, loaded.split(sizes, dim=0)):
                layer.weight_loader(param, part, shard)

        param.weight_loader = loader


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict = {}  # the checkpoint's names are ours already

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype | None = None, quant=None):
        super().__init__(cfg, dtype, quant)
        hd = config_head_dim(cfg)
        q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
        for layer in self.model.layers:
            load_fused(layer.self_attn.qkv_proj, ["q", "k", "v"], [q, kv, kv])
            load_fused(layer.mlp.gate_up_proj, [0, 1], [inter, inter])
