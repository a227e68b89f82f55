"""LoRA adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors), read and checked against the base
model: which of fulcrum's linear layers each A/B pair goes to (q/k/v into qkv_proj's shards, gate/up into
gate_up_proj's), its scaling (alpha / r, or alpha / sqrt(r) with rsLoRA), and every shape. What fulcrum does not run
(DoRA, embedding or LM-head targets, modules_to_save, biases, per-module alphas) is refused by name."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from fulcrum.errors import ModelLoadError
from fulcrum.layers.linear import LinearBase
from fulcrum.layers.lora import LoRASlots

# the linear layers an adapter may target, by their checkpoint names
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fulcrum's layers that hold slots, and their shards in output order
LAYERS = {"qkv_proj": ("q", "k", "v"), "o_proj": (None,), "gate_up_proj": (0, 1), "down_proj": (None,)}
_REFUSED_TARGETS = ("embed_tokens", "lm_head")


class LoRAError(ModelLoadError):
    """An adapter that cannot be served on this model (HTTP 400 when loaded at run time); `param`: the request field
    at fault (lora_path: the adapter itself; lora_name: a name taken or unknown)."""

    def __init__(self, message: str, param: str = "lora_path"):
        super().__init__(message)
        self.param = param


@dataclass
class LoRAAdapter:
    """An adapter read into host memory: per fulcrum layer name, per output shard, (A [r, in], B [out, r]) or None,
    and that layer's scaling."""

    name: str
    path: Path
    rank: int
    layers: dict[str, tuple[list[tuple[torch.Tensor, torch.Tensor] | None], float]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for shards, _ in self.layers.values() for ab in shards if ab for t in ab
        )


def slot_layers(model: nn.Module) -> dict[str, LinearBase]:
    """The model's linear layers that take adapters: attention's qkv and o, the dense MLP's gate_up and down (a MoE's
    experts take none)."""
    out = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, LinearBase) and leaf in LAYERS and ".layers." in f".{name}":
            out[name] = module
    return out


def attach_slots(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> dict[str, LinearBase]:
    """Give every adapter-taking layer its slots (zeros: no adapter) in the activations' `dtype`; returns those
    layers by name."""
    layers = slot_layers(model)
    for layer in layers.values():
        if layer.tp_size > 1:
            raise LoRAError("LoRA adapters are not supported with tensor parallelism yet")
        device = next(p for p in layer.parameters()).device
        layer.lora = LoRASlots(max_loras, max_rank, layer.input_size, layer.output_sizes, dtype, device)
    return layers


def read_adapter(name: str, path: str | Path, layers: dict[str, LinearBase], max_rank: int) -> LoRAAdapter:
    """Read and check an adapter folder against the model's slot layers (attach_slots)."""
    path = Path(path)
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise LoRAError(f"adapter {name!r}: {f} is missing (a PEFT adapter folder has adapter_config.json and "
                            "adapter_model.safetensors)")  # fmt: skip
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"adapter {name!r}: {cfg_file} cannot be read: {e}") from None
    _check_config(name, cfg)
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    tensors = load_file(weights_file)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        base, _, kind = key.rpartition(".lora_")
        if not base or kind not in ("A.weight", "B.weight"):
            raise LoRAError(f"adapter {name!r}: tensor {key} is not a LoRA A or B weight (DoRA, biases and "
                            "modules_to_save are not supported)")  # fmt: skip
        pairs.setdefault(base.removeprefix("base_model.model."), {})[kind[0]] = t
    adapter = LoRAAdapter(name, path, 0)
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: {module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        prefix, _, leaf = module.rpartition(".")
        if leaf in _REFUSED_TARGETS or leaf not in TARGETS:
            raise LoRAError(f"adapter {name!r}: target {leaf!r} ({module}) is not supported; fulcrum applies adapters "
                            f"to {', '.join(TARGETS)}")  # fmt: skip
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(f"adapter {name!r}: rank {rank} ({module}) is above --max-lora-rank {max_rank}")
        dst, shard = _destination(prefix, leaf)
        layer = layers.get(dst)
        if layer is None:
            raise LoRAError(f"adapter {name!r}: {module} has no layer in this model")
        idx = LAYERS[dst.rsplit(".", 1)[-1]].index(shard)
        want_a, want_b = (rank, layer.input_size), (layer.output_sizes[idx], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoRAError(f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model's "
                            f"layer takes A {want_a} and B {want_b} (an adapter of another base model?)")  # fmt: skip
        dtype = layer.lora.a.dtype
        shards, _ = adapter.layers.setdefault(dst, ([None] * len(layer.output_sizes), 0.0))
        shards[idx] = (a.to(dtype), b.to(torch.float32))
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        adapter.layers[dst] = (shards, scaling)
        adapter.rank = max(adapter.rank, rank)
    if not adapter.layers:
        raise LoRAError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    return adapter


def _destination(prefix: str, leaf: str) -> tuple[str, object]:
    """fulcrum's layer name and shard for a checkpoint module (model.layers.0.self_attn.q_proj -> qkv_proj, "q")."""
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return f"{prefix}.qkv_proj", leaf[0]
    if leaf in ("gate_proj", "up_proj"):
        return f"{prefix}.gate_up_proj", 0 if leaf == "gate_proj" else 1
    return f"{prefix}.{leaf}", None


def _check_config(name: str, cfg: dict) -> None:
    def refuse(what: str):
        raise LoRAError(f"adapter {name!r}: {what} is not supported")

    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        refuse("use_dora (DoRA)")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias {cfg.get('bias')!r}")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg.get('modules_to_save')!r}")
    if cfg.get("alpha_pattern"):
        refuse("alpha_pattern (a per-module alpha)")
    if cfg.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for t in targets:
        leaf = str(t).rsplit(".", 1)[-1]
        if leaf in _REFUSED_TARGETS:
            refuse(f"target module {t!r} (the embedding and the LM head take no adapter here)")
