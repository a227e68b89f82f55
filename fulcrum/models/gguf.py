"""Weights from a llama.cpp GGUF file, under the Hugging Face checkpoint names fulcrum's loader takes: GGUF's
tensor names mapped back with gguf's own table (the one llama.cpp's converter names them by), Llama's q/k rows put
back in Hugging Face's rotary layout, and every block type gguf can dequantize (Q8_0, Q4_0 ...) dequantized. The
tensors are read from the memory-mapped file at the places the file's folder lists (fulcrum.model_folder.from_gguf)."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fulcrum.errors import WeightLoadError
from fulcrum.model_folder.from_gguf import FLOAT_DTYPES, GGUF_LINK, GGUF_TENSORS
from fulcrum.model_folder.hf_config import head_dim as config_head_dim

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


def tensor_values(raw: np.ndarray, ggml_type: str, shape: list[int]) -> torch.Tensor:
    """A tensor's bytes as a torch tensor of `shape`: F32/F16/BF16 viewed as they are, blocks dequantized to
    float32 by gguf.quants."""
    from gguf import GGMLQuantizationType, dequantize, quant_shape_to_byte_shape

    with warnings.catch_warnings():  # views of a read-only map: only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        if ggml_type in ("F32", "F16"):
            return torch.from_numpy(raw.view(np.float32 if ggml_type == "F32" else np.float16).reshape(shape))
        if ggml_type == "BF16":  # numpy has no bfloat16
            return torch.from_numpy(raw.view(np.int16).reshape(shape)).view(torch.bfloat16)
    qtype = GGMLQuantizationType[ggml_type]
    blocks = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype)))


def gguf_weights(model: nn.Module, folder: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, str]]:
    """(name, tensor) under Hugging Face names for every tensor of a GGUF folder's file, and each name's GGUF name
    (for the loader's messages). A tensor the model has no place for, or that the file cuts short, fails naming it."""
    file = Path(os.readlink(folder / GGUF_LINK))  # the file as it was given (a Hub snapshot's link, not its blob)
    listing = json.loads((folder / GGUF_TENSORS).read_text())
    arch, table = listing["architecture"], listing["tensors"]
    data = np.memmap(file, dtype=np.uint8, mode="r")
    to_hf = gguf_to_hf_names(model, arch)
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    hd = config_head_dim(cfg)
    blocks = sorted({t["type"] for t in table} - FLOAT_DTYPES.keys())
    if blocks:
        log.info("GGUF %s: dequantizing %s at load (fulcrum has no kernel for GGUF blocks)", file, ", ".join(blocks))

    def tensors():
        for t in table:
            if t["name"] in CONSUMED:
                continue
            name = to_hf.get(t["name"])
            if name is None:
                raise WeightLoadError(
                    f"GGUF tensor {t['name']} {tuple(t['shape'])} has no parameter in {type(model).__name__}"
                )
            end = t["offset"] + t["nbytes"]
            if end > len(data):
                raise WeightLoadError(f"GGUF file {file} is truncated: tensor {t['name']} ends at byte {end}")
            try:
                w = tensor_values(data[t["offset"] : end], t["type"], t["shape"])
            except NotImplementedError:
                raise WeightLoadError(f"GGUF tensor {t['name']} is {t['type']}, which gguf cannot dequantize") from None
            module = name.rsplit(".", 2)[-2]
            if arch == "llama" and module in heads and w.shape[0] == heads[module] * hd:
                w = unpermute_rotary(w, heads[module])
            yield name, w

    return tensors(), {hf: g for g, hf in to_hf.items()}
