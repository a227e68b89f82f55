"""Weights from a llama.cpp GGUF file, under the Hugging Face checkpoint names fulcrum's loader takes (mapped back by
fulcrum.models.gguf_names). Block-quantized tensors (Q8_0, Q4_K ...) go, as their bytes, to the layers that keep them
quantized (fulcrum.quant.gguf: every linear layer and the embedding of a quantized file); anything else, and blocks
of a tensor no such layer takes (MoE experts), is dequantized. The tensors are read from the memory-mapped file at
the places the file's folder lists (fulcrum.model_folder.from_gguf)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from torch import nn

from fulcrum.errors import WeightLoadError
from fulcrum.model_folder.from_gguf import FLOAT_DTYPES, GGUF_LINK, GGUF_TENSORS
from fulcrum.models.gguf_names import fix_values, gguf_to_hf_names, row_order
from fulcrum.quant.gguf import GGUFRaw, tensor_values

log = logging.getLogger(__name__)

# Tensors the file holds that are no parameter: Llama 3's frequency divisors went into config.json's rope settings
CONSUMED = ("rope_freqs.weight",)


def gguf_weights(
    model: nn.Module, folder: Path, takes_raw: Callable[[str], bool] = lambda name: False
) -> tuple[Iterator[tuple[str, object]], dict[str, str]]:
    """(name, tensor) under Hugging Face names for every tensor of a GGUF folder's file, and each name's GGUF name
    (for the loader's messages). A block-quantized tensor whose parameter `takes_raw` comes as a GGUFRaw (its bytes,
    type and shape), every other as float values. A tensor the model has no place for, or that the file cuts short,
    fails naming it."""
    file = Path(os.readlink(folder / GGUF_LINK))  # the file as it was given (a Hub snapshot's link, not its blob)
    listing = json.loads((folder / GGUF_TENSORS).read_text())
    arch, table = listing["architecture"], listing["tensors"]
    data = np.memmap(file, dtype=np.uint8, mode="r")
    to_hf = gguf_to_hf_names(model, arch)
    cfg = model.config
    dequantized: set[str] = set()

    def values(t):
        try:
            w = tensor_values(data[t["offset"] : t["offset"] + t["nbytes"]], t["type"], t["shape"])
        except NotImplementedError:
            raise WeightLoadError(f"GGUF tensor {t['name']} is {t['type']}, which gguf cannot dequantize") from None
        if t["type"] not in FLOAT_DTYPES:
            dequantized.add(t["type"])
        return w

    def ordered(w, name):
        rows = row_order(arch, name, w.shape[0], cfg)
        return w if rows is None else w[rows]

    # a tied head that keeps blocks (a quantized file without output.weight) takes the embedding's tensor as its own
    tied_head = (
        getattr(model, "tie_word_embeddings", False)
        and takes_raw("lm_head.weight")
        and not any(t["name"] == "output.weight" for t in table)
    )

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
            if isinstance(name, list):  # experts stacked along the first dimension
                w = values(t)
                if w.shape[0] != len(name):
                    raise WeightLoadError(
                        f"GGUF tensor {t['name']} stacks {w.shape[0]} experts, the model has {len(name)}"
                    )
                for expert, n in zip(w, name):
                    yield n, fix_values(arch, n, ordered(expert, n), cfg)
                continue
            for n in [name, "lm_head.weight"] if tied_head and name == "model.embed_tokens.weight" else [name]:
                if t["type"] not in FLOAT_DTYPES and len(t["shape"]) == 2 and takes_raw(n):
                    rows = row_order(arch, n, t["shape"][0], cfg)
                    yield n, GGUFRaw(data[t["offset"] : end], t["type"], tuple(t["shape"]), t["name"], rows)
                else:
                    yield n, fix_values(arch, n, ordered(values(t), n), cfg)
        if dequantized:
            log.info("GGUF %s: %s dequantized at load where no layer keeps them quantized", file,
                     ", ".join(sorted(dequantized)))  # fmt: skip

    names = {}
    for g, hf in to_hf.items():
        for n in hf if isinstance(hf, list) else [hf]:
            names[n] = g
    return tensors(), names
