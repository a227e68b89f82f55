"""compressed-tensors checkpoints (what llm-compressor writes), weight-only: config_groups name the modules each
scheme quantizes (`targets`: "Linear", names, "re:" regexes; `ignore` likewise). The formats read are SUPPORTED's
(their layouts: `CTInt4Method`, `CTChannelsMethod`). Activations quantized on the fly (dynamic input_activations) run
unquantized: the weights are what is read.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from fulcrum.errors import ModelLoadError
from fulcrum.quant.checkpoint import (
    FLOATS,
    CheckpointChannels,
    CheckpointFormat,
    CheckpointInt4,
    TensorSpec,
    check_group,
    unpack_int32,
    unsupported,
)

log = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
SUPPORTED = (
    "int4 pack-quantized (group, channel or tensor; symmetric or not)",
    "int8 pack-quantized, int-quantized or naive-quantized (channel or tensor, symmetric)",
    "fp8 e4m3 float-quantized or naive-quantized (channel or tensor)",
)


@dataclass(frozen=True)
class CTScheme:
    format: str
    bits: int
    type: str  # int or float
    symmetric: bool
    strategy: str  # group, channel or tensor
    group_size: int  # -1 unless strategy is group

    def __str__(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.bits}"
        where = f"group {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        return f"{kind} ({where}{'' if self.symmetric else ', asymmetric'})"


def read_scheme(name: str, group: dict, default_format: str | None) -> CTScheme:
    w = group.get("weights")
    if not w:
        raise ModelLoadError(f"compressed-tensors {name} quantizes no weights; fulcrum reads weight quantization only")
    if group.get("output_activations"):
        raise ModelLoadError(f"compressed-tensors {name}: output activation quantization is not supported")
    act = group.get("input_activations")
    if act and not act.get("dynamic"):
        raise ModelLoadError(
            f"compressed-tensors {name}: static input activation scales (input_scale) are not supported; "
            "dynamic ones are (fulcrum then runs the activations unquantized)"
        )
    fmt = group.get("format") or default_format
    if fmt not in FORMATS:
        raise unsupported(f"compressed-tensors {name} format", fmt, FORMATS)
    bits, kind, symmetric = int(w.get("num_bits", 8)), str(w.get("type", "int")).lower(), bool(w.get("symmetric", True))
    size = w.get("group_size")
    strategy = str(w.get("strategy") or ("tensor" if size is None else "channel" if size == -1 else "group")).lower()
    scheme = CTScheme(fmt, bits, kind, symmetric, strategy, -1 if strategy != "group" else size)
    packed, plain = fmt == "pack-quantized", fmt in ("int-quantized", "naive-quantized")
    ok = (
        (kind == "int" and bits == 4 and packed and strategy in ("group", "channel", "tensor"))
        or (kind == "int" and bits == 8 and (packed or plain) and strategy in ("channel", "tensor") and symmetric)
        or (kind == "float" and bits == 8 and fmt != "pack-quantized" and strategy in ("channel", "tensor"))
    )
    if w.get("actorder") in ("group", "dynamic", True):
        raise ModelLoadError(f"compressed-tensors {name}: actorder 'group' (weight_g_idx) is not supported")
    if not ok:
        raise ModelLoadError(
            f"compressed-tensors {name}: {kind} {bits}-bit {fmt}, strategy {strategy}"
            f"{'' if symmetric else ', asymmetric'} is not supported (supported: {'; '.join(SUPPORTED)})"
        )
    if strategy == "group":
        check_group(size, f"compressed-tensors {name}")
    if act:
        log.warning("compressed-tensors %s quantizes activations on the fly; fulcrum runs them unquantized", name)
    return scheme


def matches(name: str, targets) -> bool:
    """compressed-tensors' matching for linear modules: "Linear" (the class), a "re:" regex, or the name itself."""
    return any(t == "Linear" or (re.match(t[3:], name) if t.startswith("re:") else t == name) for t in targets)


class CompressedTensorsFormat(CheckpointFormat):
    def __init__(self, config: dict):
        super().__init__(config)
        if config.get("kv_cache_scheme"):
            raise ModelLoadError("compressed-tensors kv_cache_scheme is not supported (fulcrum's --kv-cache-dtype is)")
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise ModelLoadError(f"compressed-tensors {key} is not supported (weight quantization only)")
        default = config.get("format")
        self.groups = [
            (list(g.get("targets") or []), read_scheme(name, g, default))
            for name, g in (config.get("config_groups") or {}).items()
        ]
        self.ignore = list(config.get("ignore") or [])

    def scheme(self, name):
        if matches(name, self.ignore):
            return None
        return next((s for targets, s in self.groups if matches(name, targets)), None)

    def method(self, scheme, prefix, shard_names):
        cls = CTInt4Method if scheme.bits == 4 else CTChannelsMethod
        return cls(scheme, prefix, shard_names)

    def describe(self) -> str:
        return "compressed-tensors " + "; ".join(dict.fromkeys(str(s) for _t, s in self.groups))


def scale_spec(scheme: CTScheme, in_f: int, out_f: int) -> TensorSpec:
    if scheme.strategy == "tensor":
        return TensorSpec((1,), FLOATS, out_dim=None)
    return TensorSpec((out_f, 1 if scheme.strategy == "channel" else in_f // scheme.group_size), FLOATS)


def check_shape(t: dict, in_f: int, out_f: int, name: str) -> None:
    if "weight_shape" in t and tuple(t["weight_shape"].tolist()) != (out_f, in_f):
        raise ModelLoadError(f"{name}.weight_shape is {tuple(t['weight_shape'].tolist())}, the model's {(out_f, in_f)}")


class CTInt4Method(CheckpointInt4):
    """pack-quantized int4: weight_packed int32 [O, I / 8], the signed values plus 8, value k of a word in its bits
    4k..; weight_scale [O, I / G] (group), [O, 1] (channel) or [1] (tensor); weight_shape; asymmetric:
    weight_zero_point, packed the same way along the outputs ([O / 8, I / G]). W = (q - zero) * scale."""

    name = "compressed-tensors"

    def tensors(self, in_f, out_f):
        s = self.scheme
        out = {
            "weight_packed": TensorSpec((out_f, -(-in_f // 8)), (torch.int32,)),
            "weight_scale": scale_spec(s, in_f, out_f),
            "weight_shape": TensorSpec((2,), (torch.int64, torch.int32), out_dim=None),
        }
        if not s.symmetric:  # packed along the outputs, as the scales' rows; unpacked int8 for one per tensor
            out["weight_zero_point"] = (
                TensorSpec((1,), (torch.int8,), out_dim=None)
                if s.strategy == "tensor"
                else TensorSpec((-(-out_f // 8), out["weight_scale"].shape[1]), (torch.int32,))
            )
        return out

    def convert(self, t, in_f, out_f, name):
        check_shape(t, in_f, out_f, name)
        scale = t["weight_scale"].float().reshape(-1, t["weight_scale"].shape[-1]).expand(out_f, -1)
        if self.scheme.symmetric:
            zero = torch.full_like(scale, 8)  # the stored values are the signed ones plus 8
        elif self.scheme.strategy == "tensor":
            zero = (t["weight_zero_point"].float() + 8).expand_as(scale)
        else:  # offset by 8 as the values are: (q + 8) - (z + 8) = q - z
            zero = unpack_int32(t["weight_zero_point"], 4, dim=0, size=out_f).float()
        q = unpack_int32(t["weight_packed"], 4, dim=1, size=in_f).to(torch.uint8)
        return {"q": q, "scale": scale, "zero": zero, "group": self.scheme.group_size}


class CTChannelsMethod(CheckpointChannels):
    """One byte per weight, symmetric, weight_scale per channel or tensor: pack-quantized int8 (weight_packed int32
    [O, I / 4], the signed values plus 128; weight_shape), int-quantized / naive-quantized int8 (weight int8 [O, I])
    or float-quantized / naive-quantized fp8 e4m3 (weight float8_e4m3fn [O, I])."""

    name = "compressed-tensors"

    def tensors(self, in_f, out_f):
        s = self.scheme
        out = {"weight_scale": scale_spec(s, in_f, out_f)}
        if s.format == "pack-quantized":
            out["weight_packed"] = TensorSpec((out_f, -(-in_f // 4)), (torch.int32,))
            out["weight_shape"] = TensorSpec((2,), (torch.int64, torch.int32), out_dim=None)
        else:
            out["weight"] = TensorSpec((out_f, in_f), (torch.float8_e4m3fn,) if s.type == "float" else (torch.int8,))
        return out

    def convert(self, t, in_f, out_f, name):
        check_shape(t, in_f, out_f, name)
        if "weight_packed" in t:
            q = (unpack_int32(t["weight_packed"], 8, dim=1, size=in_f) - 128).to(torch.int8)
        else:
            q = t["weight"].clone()
        return {"q": q, "scale": t["weight_scale"].float().reshape(-1).expand(out_f).clone()}
