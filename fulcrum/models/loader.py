"""Weight loader for Hugging Face model folders: single or sharded safetensors, memory-mapped, or the GGUF file
behind a GGUF's folder (fulcrum.models.gguf), with q/k/v and gate/up stacked into one parameter each. Fails loudly
on a missing, unexpected or mis-shaped tensor, naming it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fulcrum.config import CHECKPOINT_QUANTIZATIONS, ModelConfig
from fulcrum.errors import ModelLoadError, WeightLoadError, WeightShapeError
from fulcrum.layers.embedding import DENSE, ParallelLMHead
from fulcrum.layers.linear import copy_checked
from fulcrum.model_folder.from_gguf import GGUF_LINK
from fulcrum.models.gguf import gguf_weights
from fulcrum.models.registry import model_class
from fulcrum.quant import describe, method_factory

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards that are not in {path}: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    return files


def iterate_weights(path: Path):
    """(name, tensor) for every checkpoint tensor; tensors are memory-mapped views of the files."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


def _packed_target(model: nn.Module, name: str) -> tuple[str, object]:
    """The parameter (and shard) a checkpoint tensor loads into: the first packed_modules_mapping entry, in the
    mapping's order, whose dotted name occurs in the tensor's. Looked up by the name's runs of components, not by
    trying every entry: a MoE mapping has three per expert (768 for DeepSeek-V3's 256), for each of ~100k tensors."""
    mapping = getattr(model, "packed_modules_mapping", {})
    if not mapping:
        return name, None
    key = id(mapping)
    cached = getattr(model, "_packed_lookup", None)
    if cached is None or cached[0] != key:
        order = {src: i for i, src in enumerate(mapping)}
        longest = max(src.count(".") + 1 for src in mapping)
        cached = (key, order, longest)
        object.__setattr__(model, "_packed_lookup", cached)
    _, order, longest = cached
    parts = name.split(".")
    best = None
    for i in range(1, len(parts) - 1):  # a run with a component before and after it, as f".{src}." needs
        for n in range(1, min(longest, len(parts) - 1 - i) + 1):
            src = ".".join(parts[i : i + n])
            if src in order and (best is None or order[src] < order[best]):
                best = src
    if best is None:
        return name, None
    dst, shard = mapping[best]
    return name.replace(f".{best}.", f".{dst}.", 1), shard


def _expected_shards(model: nn.Module) -> dict[str, set]:
    """For each stacked parameter fragment, the shard ids that must all be loaded."""
    out: dict[str, set] = {}
    for _src, (dst, shard) in getattr(model, "packed_modules_mapping", {}).items():
        out.setdefault(dst, set()).add(shard)
    return out


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded)


def load_weights(model: nn.Module, path: Path) -> None:
    if (path / GGUF_LINK).exists():
        params = dict(model.named_parameters())

        def takes_raw(name: str) -> bool:  # a parameter that keeps a GGUF tensor's blocks (fulcrum.quant.gguf)
            return getattr(params.get(_packed_target(model, name)[0]), "takes_gguf_raw", False)

        weights, gguf_names = gguf_weights(model, path, takes_raw)
        file = os.readlink(path / GGUF_LINK)
        load_named_weights(model, weights, file, lambda name: f"{gguf_names.get(name, '?')} ({name})")
    else:
        load_named_weights(model, iterate_weights(path), str(path))


def load_named_weights(model: nn.Module, weights, source: str, label=lambda name: name) -> None:
    """Load (name, tensor) pairs under Hugging Face checkpoint names from `source` (a folder or file, for messages);
    `label(name)` is how messages name a tensor (a GGUF file's own name with it)."""
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: dict[str, set] = {}
    skip = getattr(model, "skip_weight", None)  # a model's tensors that serve no layer of it (DeepSeek-V3's MTP)
    rename = getattr(model, "checkpoint_name", None)  # a vision-language checkpoint's names (None: vision tower)
    for name, tensor in weights:
        if rename is not None and (name := rename(name)) is None:
            continue
        tied_head = tied and name == "lm_head.weight" and name not in params  # the embedding's tensor already
        if name.endswith(IGNORED_SUFFIXES) or tied_head or (skip and skip(name)):
            continue
        param_name, shard = _packed_target(model, name)
        param = params.get(param_name)
        if param is None and f"model.{param_name}" in params:  # a bare backbone's checkpoint (no "model." prefix)
            param_name = f"model.{param_name}"
            param = params[param_name]
        if param is None and name.endswith(".bias") and not tensor.any():
            continue  # a zero bias the model has no place for (GPTQ tools write one for every linear layer)
        if param is None:
            raise WeightLoadError(
                f"checkpoint tensor {label(name)} {tuple(tensor.shape)} has no parameter in {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        except WeightShapeError as e:
            raise WeightLoadError(
                f"tensor {label(name)}: checkpoint shape {e.got}, model expects {e.expected}"
                + (f" (shard {shard!r} of {param_name})" if shard is not None else "")
            ) from None
        except WeightLoadError as e:  # a quantized checkpoint's tensor of another dtype than its format's
            raise WeightLoadError(f"tensor {label(name)}: {e}") from None
        loaded.setdefault(param_name, set()).add(shard)

    stacks = _expected_shards(model)
    missing = []
    for pname, param in params.items():
        if getattr(param, "optional_in_checkpoint", False):
            continue
        fragment = next((d for d in stacks if f".{d}." in pname), None)
        want = stacks[fragment] if fragment else {None}
        for shard in sorted(want - loaded.get(pname, set()), key=str):
            src = pname
            if fragment:
                src = next(s for s, (d, sh) in model.packed_modules_mapping.items() if d == fragment and sh == shard)
                src = pname.replace(f".{fragment}.", f".{src}.")
            missing.append(f"{label(src)} (model expects {tuple(param.shape)}{' stacked' if fragment else ''})")
    if missing:
        raise WeightLoadError(f"checkpoint {source} lacks {len(missing)} tensor(s): " + "; ".join(missing[:10]))
    finish_loading(model)


def finish_loading(model: nn.Module) -> None:
    """Once every weight is in place: each layer's quant method repacks (or quantizes) its weights, then the
    model's own hook runs (a tied embedding reading the quantized head's table)."""
    methods = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None and isinstance(module, ParallelLMHead):
            method = DENSE  # an unquantized head is prepacked as the linears are (on AMX)
        if method is not None:
            method.process_weights_after_loading(module)
            methods.append((module, method))
    for module, method in methods:  # the optional copies for few rows, once every layer has its packed weight
        if hasattr(method, "pack_small"):
            method.pack_small(module)
    if hasattr(model, "after_loading"):
        model.after_loading()
    for module in model.modules():  # an embedding whose GGUF table no quantized head shares converts its own
        if hasattr(module, "finish_gguf_table"):
            module.finish_gguf_table()


def load_model(config: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    cls = model_class(config.hf_config)
    checkpoint = getattr(config.hf_config, "quantization_config", None)
    quant = method_factory(
        config.quantization,
        config.quantization_group_size,
        checkpoint=checkpoint,
        packed_modules_mapping=getattr(cls, "packed_modules_mapping", {}),
        tie_word_embeddings=bool(getattr(config.hf_config, "tie_word_embeddings", False)),
    )
    if config.quantization in CHECKPOINT_QUANTIZATIONS:
        log.info("quantized checkpoint: %s", describe(config.quantization, checkpoint=checkpoint))
    with torch.device(device):
        model = cls(config.hf_config, dtype=config.dtype, quant=quant)
    untied = not getattr(model, "tie_word_embeddings", False)  # a tied head is the embedding table, which must load
    if config.task == "embed" and untied and getattr(model, "lm_head", None) is not None:
        for p in model.lm_head.parameters():  # an embedding model never computes logits: its head may be absent
            p.optional_in_checkpoint = True
    load_weights(model, config.path)
    return model.eval()
