"""Which Hugging Face checkpoint tensor each tensor of a GGUF file is, per architecture, and the value fixes that
llama.cpp's converter applied and loading undoes: gguf's own name table (the one llama.cpp's converter names tensors
by), MoE experts that the file stacks in one tensor per layer (ffn_gate_exps ...) named one by one, Llama's q/k rows
put back in Hugging Face's rotary layout, Gemma's norms stored as 1 + weight taken back to the weight."""

from __future__ import annotations

import re

import torch
from torch import nn

from fulcrum.model_folder.hf_config import head_dim as config_head_dim

# One expert's weight in a Hugging Face MoE checkpoint (Qwen2-MoE, Qwen3-MoE): llama.cpp's converter stacks a layer's
# experts into blk.N.ffn_{gate,up,down}_exps.weight, expert E at index E of the first dimension
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# Architectures whose converter stores each RMSNorm weight w as 1 + w (Gemma's norms multiply by 1 + w)
NORM_PLUS_ONE = ("gemma2", "gemma3")


def checkpoint_names(model: nn.Module) -> list[str]:
    """The Hugging Face checkpoint name of every tensor the model takes (stacked parameters split back into the
    q/k/v or gate/up tensors they are loaded from), the tied LM head's included."""
    names = ["lm_head.weight"] if getattr(model, "tie_word_embeddings", False) else []
    packed = getattr(model, "packed_modules_mapping", {})
    for name, _ in model.named_parameters():
        srcs = [name.replace(f".{dst}.", f".{src}.") for src, (dst, _) in packed.items() if f".{dst}." in name]
        names += srcs or [name]
    return names


def gguf_to_hf_names(model: nn.Module, arch: str) -> dict[str, str | list[str]]:
    """GGUF tensor name -> Hugging Face checkpoint name, for the tensors this model takes; a list of names (one per
    expert, in order) for a tensor that stacks experts along its first dimension."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out: dict[str, str | list[str]] = {}
    experts: dict[str, dict[int, str]] = {}
    for name in checkpoint_names(model):
        if m := EXPERT.fullmatch(name):
            experts.setdefault(f"blk.{m[1]}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = name
            continue
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            out[gguf_name] = name
    for gguf_name, by_index in experts.items():
        out[gguf_name] = [by_index[e] for e in sorted(by_index)]
    return out


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of q/k rows (weights or biases): it interleaves each head's two
    rotary halves for GGML's rope; Hugging Face's Llama keeps them as halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def row_order(arch: str, hf_name: str, rows: int, config) -> torch.Tensor | None:
    """The order to take a tensor's rows (its first dimension) in, or None to keep them: applied to the float
    values and to quantized rows alike (a block never spans rows). Llama's q/k rows un-permuted."""
    module = hf_name.rsplit(".", 2)[-2]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    if arch == "llama" and module in heads and rows == heads[module] * config_head_dim(config):
        return unpermute_rotary(torch.arange(rows), heads[module])
    return None


def fix_values(arch: str, hf_name: str, w: torch.Tensor, config) -> torch.Tensor:
    """A float tensor's values as the Hugging Face model takes them (after row_order): what the converter changed
    beyond the order of rows: Gemma's norms stored as 1 + weight; Qwen2-MoE's shared expert gate, a [1, hidden]
    matrix in the checkpoint, is a vector of hidden values in llama.cpp's files."""
    if arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
        return w - 1
    if hf_name.endswith(".mlp.shared_expert_gate.weight") and w.ndim == 1:
        return w.reshape(1, -1)
    return w
