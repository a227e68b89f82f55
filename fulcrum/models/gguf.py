"""Weights from a llama.cpp GGUF file, under the Hugging Face checkpoint names fulcrum's loader takes: GGUF's
tensor names mapped back with gguf's own table (the one llama.cpp's converter names them by), Llama's q/k rows put
back in Hugging Face's rotary layout, and every block type gguf can dequantize (Q8_0, Q4_0 ...) dequantized."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fulcrum.errors import WeightLoadError
from fulcrum.gguf_folder import FLOAT_DTYPES, read_gguf
from fulcrum.utils.hf_config import head_dim as config_head_dim

log = logging.getLogger(__name__)

# Tensors the file holds that are no parameter: Llama 3's frequency divisors went into config.json's rope settings
CONSUMED = ("rope_freqs.weight",)


def checkpoint_names(model: nn.Module) -> list[str]:
    """The Hugging Face checkpoint name of every tensor the model takes (stacked parameters split back into the
    q/k/v or gate/up tensors they are loaded from), the tied LM head's included."""
    names = ["lm_head.weight"] if getattr(model, "tie_word_embeddings", False) else []
    packed = getattr(model, "packed_modules_mapping", {})
    for name, _ in model.named_parameters():
        srcs = [name.replace(f".{dst}.", f".{src}.") for src, (dst, _) in packed.items() if f".{dst}." in name]
        names += srcs or [name]
    return names


def gguf_to_hf_names(model: nn.Module, arch: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face checkpoint name, for the tensors this model takes."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out = {}
    for name in checkpoint_names(model):
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            out[gguf_name] = name
    return out


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of q/k rows (weights or biases): it interleaves each head's two
    rotary halves for GGML's rope; Hugging Face's Llama keeps them as halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_values(t) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in torch's dimension order: F32/F16/BF16 as views of the mapped file,
    blocks dequantized to float32 by gguf.quants."""
    from gguf import GGMLQuantizationType, dequantize

    if t.tensor_type.name in FLOAT_DTYPES:
        with warnings.catch_warnings():  # a read-only map: only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(t.data)
        # numpy has no bfloat16: the reader gives its bytes, two per value
        return data.view(torch.bfloat16) if t.tensor_type == GGMLQuantizationType.BF16 else data
    try:
        return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type)))
    except NotImplementedError:
        raise WeightLoadError(
            f"GGUF tensor {t.name} is stored as {t.tensor_type.name}, which gguf cannot dequantize"
        ) from None


def gguf_weights(model: nn.Module, file: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, str]]:
    """(name, tensor) under Hugging Face names for every tensor of the file, and each name's GGUF name (for the
    loader's messages). A tensor the model has no place for fails naming it."""
    reader = read_gguf(file)
    arch = reader.get_field("general.architecture").contents()
    to_hf = gguf_to_hf_names(model, arch)
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    hd = config_head_dim(cfg)
    blocks = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type.name not in FLOAT_DTYPES})
    if blocks:
        log.info("GGUF %s: dequantizing %s at load (fulcrum has no kernel for GGUF blocks)", file, ", ".join(blocks))

    def tensors():
        for t in reader.tensors:
            if t.name in CONSUMED:
                continue
            name = to_hf.get(t.name)
            if name is None:
                shape = tuple(int(d) for d in reversed(t.shape))
                raise WeightLoadError(f"GGUF tensor {t.name} {shape} has no parameter in {type(model).__name__}")
            w = tensor_values(t)
            module = name.rsplit(".", 2)[-2]
            if arch == "llama" and module in heads and w.shape[0] == heads[module] * hd:
                w = unpermute_rotary(w, heads[module])
            yield name, w

    return tensors(), {hf: g for g, hf in to_hf.items()}
