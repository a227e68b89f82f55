"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors): the linear method that loads a layer's tensors as the
checkpoint stores them, then converts them to fulcrum's own int4 / int8 / fp8 layouts (the online methods', whose
kernels then run them unchanged), and the factory that reads config.json's quantization_config to choose, module by
module, a method or full precision (ignored modules: the LM head, modules_to_not_convert, `ignore` lists).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fulcrum.config import FP8_BLOCK, INT4_GROUP_SIZES
from fulcrum.errors import ModelLoadError, WeightLoadError, WeightShapeError
from fulcrum.quant import formats
from fulcrum.quant.online import Int4Method, Int8Method

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of one shard: its shape, the dtypes it may come in, and which dimension (if any)
    grows with the shard's outputs (shards are concatenated along it; without one they are stacked)."""

    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    out_dim: int | None = 0
    optional: bool = False  # absent from some checkpoints (its value stays `fill`)
    fill: int = 0

    @property
    def storage(self) -> torch.dtype:
        return torch.float32 if self.dtypes[0].is_floating_point and self.dtypes[0] in FLOATS else self.dtypes[0]


def shard_index(shard_id) -> int:
    """The position of a loader's shard id among a layer's output_sizes: q/k/v, or gate/up's 0/1."""
    if shard_id is None:
        return 0
    return "qkv".index(shard_id) if isinstance(shard_id, str) else int(shard_id)


def unpack_int32(words: torch.Tensor, bits: int, dim: int, size: int | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits values each, the lowest bits first: value k of word c is element
    c * 32 / bits + k along `dim` (cut to `size`). Returns the unsigned values as int16."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    w = words.to(torch.int64).movedim(dim, -1)
    values = ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], w.shape[-1] * per)
    if size is not None:
        values = values[..., :size]
    return values.movedim(-1, dim).to(torch.int16)


def kernel_group(group: int, in_f: int, what: str) -> int:
    """The int4 kernels' group size for a checkpoint's `group` (-1 or in_f: one group per output channel): itself
    when the kernels take it, else the largest they take that divides it (each of its scales then repeats)."""
    group = in_f if group in (-1, None) else group
    fits = [g for g in sorted(INT4_GROUP_SIZES, reverse=True) if group % g == 0 and in_f % g == 0]
    if not fits or in_f % group:
        raise ModelLoadError(
            f"{what}: group size {group} over {in_f} inputs is not one the int4 kernels run (they take "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}, or a multiple of one that divides the inputs)"
        )
    return fits[0]


def check_group(group, what: str) -> int:
    """A checkpoint's group size, checked to be one kernel_group maps (-1: one group per output channel)."""
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % min(INT4_GROUP_SIZES) == 0)):
        raise ModelLoadError(
            f"{what} group size {group!r} is not supported (supported: {', '.join(map(str, INT4_GROUP_SIZES))}, "
            f"multiples of {min(INT4_GROUP_SIZES)}, and -1 for one group per output channel)"
        )
    return group


class CheckpointLinear:
    """Mixin for a quantized format's online method (whose apply, kernels and dequantize it keeps): the layer's
    parameters are the checkpoint's tensors, named as there; after loading, each shard is converted. A layer stacks
    several checkpoint modules (q/k/v, gate/up): each registered tensor holds every shard, concatenated along the
    outputs where it has them, and each shard is converted on its own, then the results are concatenated."""

    from_checkpoint = True  # the LM head registers these tensors in place of its full-precision weight

    def __init__(self, scheme, prefix: str, shard_names: list[str]):
        """`scheme`: the format's settings for this layer; `shard_names`: its checkpoint modules (q_proj, ...)."""
        self.scheme, self.prefix, self.shard_names = scheme, prefix, shard_names

    # -- what a format defines ---------------------------------------------------------------------

    def tensors(self, in_f: int, out_f: int) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def convert(self, t: dict[str, torch.Tensor], in_f: int, out_f: int, name: str) -> dict:
        """One shard's checkpoint tensors (by name) in the terms `merge` takes."""
        raise NotImplementedError

    def merge(self, layer: nn.Module, shards: list[dict]) -> dict[str, torch.Tensor]:
        """The converted shards as the layer's buffers (the online method's names and layout)."""
        raise NotImplementedError

    # -- the seam ----------------------------------------------------------------------------------

    def create_weights(self, layer, input_size, output_sizes, dtype):
        if layer.tp_size > 1:
            raise ModelLoadError(f"{self.name} checkpoints with tensor parallel > 1 are not supported yet")
        self.input_size, self.output_sizes, self.dtype = input_size, list(output_sizes), dtype
        self.specs = [self.tensors(input_size, o) for o in self.output_sizes]
        for name, first in self.specs[0].items():
            per = [s[name] for s in self.specs]
            if first.out_dim is None:
                if any(p.shape != first.shape for p in per):
                    raise ModelLoadError(f"{self.prefix}.{name}: its shards differ in shape, so they cannot stack")
                shape = (len(per), *first.shape)
            else:
                shape = list(first.shape)
                shape[first.out_dim] = sum(p.shape[first.out_dim] for p in per)
            param = nn.Parameter(torch.full(tuple(shape), first.fill, dtype=first.storage), requires_grad=False)
            param.weight_loader = functools.partial(self.load_tensor, name)
            param.optional_in_checkpoint = first.optional
            layer.register_parameter(name, param)

    def shard_view(self, param: torch.Tensor, name: str, index: int) -> torch.Tensor:
        spec = self.specs[index][name]
        if spec.out_dim is None:
            return param[index]
        start = sum(s[name].shape[spec.out_dim] for s in self.specs[:index])
        return param.narrow(spec.out_dim, start, spec.shape[spec.out_dim])

    def load_tensor(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        index = shard_index(shard_id)
        spec = self.specs[index][name]
        if loaded.dtype not in spec.dtypes:
            raise WeightLoadError(
                f"dtype {loaded.dtype}, {self.name} stores it as {' or '.join(str(d) for d in spec.dtypes)}"
            )
        if tuple(loaded.shape) != spec.shape:
            raise WeightShapeError(spec.shape, loaded.shape)
        self.shard_view(param.data, name, index).copy_(loaded)

    def process_weights_after_loading(self, layer):
        shards = []
        for i, out_f in enumerate(self.output_sizes):
            t = {name: self.shard_view(getattr(layer, name).data, name, i) for name in self.specs[i]}
            shards.append(self.convert(t, self.input_size, out_f, self.shard_names[i]))
        for name in self.specs[0]:
            delattr(layer, name)
        for key, value in self.merge(layer, shards).items():
            layer.register_buffer(key, value.contiguous())
        layer.out_dtype = self.dtype


class CheckpointInt4(CheckpointLinear, Int4Method):
    """4-bit formats: each shard converts to (q [O, I] in 0..15, scale and zero [O, I / group], group) with
    W = (q - zero) * scale, optionally after permuting its inputs (`perm`: GPTQ's act order), and becomes the
    int4 layout (offset = -zero * scale) in the group size the kernels take."""

    def __init__(self, scheme, prefix: str, shard_names: list[str]):
        CheckpointLinear.__init__(self, scheme, prefix, shard_names)
        Int4Method.__init__(self, scheme.group_size)  # the checkpoint's; merge sets the kernels'

    def create_weights(self, layer, input_size, output_sizes, dtype):
        kernel_group(self.group_size, input_size, self.prefix)  # fail before any tensor is read
        super().create_weights(layer, input_size, output_sizes, dtype)

    def merge(self, layer, shards):
        in_f = self.input_size
        group = math.gcd(*(kernel_group(s["group"], in_f, self.prefix) for s in shards))
        perm = shards[0].get("perm")
        for s, name in zip(shards[1:], self.shard_names[1:]):
            other = s.get("perm")
            if (perm is None) != (other is None) or (perm is not None and not torch.equal(perm, other)):
                raise ModelLoadError(
                    f"{self.shard_names[0]} and {name} order their inputs differently (g_idx), but {self.prefix} "
                    "stacks them on one input: fulcrum needs one input order per stacked layer"
                )
        scales, offsets = [], []
        for s in shards:
            reps = (in_f if s["group"] in (-1, None) else s["group"]) // group
            scale = s["scale"].float().repeat_interleave(reps, dim=1)
            scales.append(scale)
            offsets.append(-s["zero"].float().repeat_interleave(reps, dim=1) * scale)
        self.group_size = group
        out = {
            "qweight": formats.pack_int4(torch.cat([s["q"] for s in shards])),
            "scales": torch.cat(scales),
            "offsets": torch.cat(offsets),
        }
        if perm is not None:
            out["input_perm"] = perm
        return out

    def apply(self, layer, x, bias):
        perm = getattr(layer, "input_perm", None)
        return super().apply(layer, x if perm is None else x.index_select(-1, perm), bias)

    def dequantize_rows(self, layer, rows):
        w = super().dequantize_rows(layer, rows)
        perm = getattr(layer, "input_perm", None)
        if perm is None:
            return w
        out = torch.empty_like(w)
        out[:, perm] = w  # back to the checkpoint's input order (a tied embedding's rows)
        return out


class CheckpointChannels(CheckpointLinear, Int8Method):
    """One byte per weight with a scale per output channel (int8, or fp8 e4m3: Int8Method's gemv and dequantize
    read both): each shard converts to (q [O, I], scale [O])."""

    def merge(self, layer, shards):
        return {"qweight": torch.cat([s["q"] for s in shards]), "scales": torch.cat([s["scale"] for s in shards])}


class CheckpointFormat:
    """A checkpoint's quantization_config, read once: which scheme each checkpoint module has (None: full
    precision), the method a layer of that scheme gets, and a line for the startup log."""

    def __init__(self, config: dict):
        self.config = config

    def scheme(self, name: str):
        raise NotImplementedError

    def method(self, scheme, prefix: str, shard_names: list[str]):
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def setting(config: dict, *keys, default=None):
    """A quantization_config value under the first of `keys` it has (tools name some settings differently)."""
    return next((config[k] for k in keys if config.get(k) is not None), default)


def unsupported(what: str, value, supported) -> ModelLoadError:
    return ModelLoadError(f"{what} {value!r} is not supported (supported: {', '.join(map(str, supported))})")


def checkpoint_format(quantization: str, config: dict) -> CheckpointFormat:
    if quantization == "gptq":
        from fulcrum.quant.gptq import GPTQFormat as fmt
    elif quantization == "awq":
        from fulcrum.quant.awq import AWQFormat as fmt
    elif quantization == FP8_BLOCK:
        from fulcrum.quant.fp8_block import BlockFp8Format as fmt
    else:
        from fulcrum.quant.compressed_tensors import CompressedTensorsFormat as fmt
    return fmt(config)


def checkpoint_factory(
    quantization: str, config: dict, packed_modules_mapping: dict, tie_word_embeddings: bool = False
) -> Callable[[str], object]:
    """`quant(prefix)` for a model loaded from a quantized checkpoint: a fresh method for the layer at `prefix`
    ("model.layers.0.self_attn.qkv_proj", "lm_head"), or None to keep it in full precision. A stacked layer's
    schemes are its checkpoint modules' (q_proj, k_proj, v_proj), which must agree."""
    fmt = checkpoint_format(quantization, config)
    stacks: dict[str, list[str]] = {}
    for src, (dst, _shard) in packed_modules_mapping.items():
        stacks.setdefault(dst, []).append(src)

    def quant(prefix: str):
        if prefix == "lm_head" and tie_word_embeddings:
            return None  # the head is the embedding table, stored in full precision
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{s}" if parent else s for s in stacks.get(leaf, [leaf])]
        schemes = [fmt.scheme(n) for n in names]
        if any(s != schemes[0] for s in schemes[1:]):
            raise ModelLoadError(
                f"{prefix} stacks {', '.join(names)}, which the checkpoint quantizes differently "
                f"({', '.join(str(s) for s in schemes)}): fulcrum needs one scheme per stacked layer"
            )
        return None if schemes[0] is None else fmt.method(schemes[0], prefix, names)

    if hasattr(fmt, "experts"):  # a format that stores MoE experts quantized (fulcrum.quant.expert_format)
        quant.experts = fmt.experts
    return quant
