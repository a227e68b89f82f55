"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers), 4-bit, read into fulcrum's int4 layout (`GPTQMethod`).
checkpoint_format "gptq" (the tools' default) stores each zero minus 1, "gptq_v2" the zero itself. With desc_act the
groups are spread over the inputs in activation order: the inputs are permuted so that each group is contiguous, and
the layer gathers its input in that order before the matmul.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fulcrum.errors import ModelLoadError
from fulcrum.quant.checkpoint import (
    FLOATS,
    CheckpointFormat,
    CheckpointInt4,
    TensorSpec,
    check_group,
    setting,
    unpack_int32,
    unsupported,
)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
V1_ZERO_OFFSETS = 0x11111111  # one per nibble: "gptq" stores each zero point minus one


@dataclass(frozen=True)
class GPTQScheme:
    group_size: int
    sym: bool
    desc_act: bool
    zeros_minus_one: bool

    def __str__(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"int4 ({group}{', desc_act' if self.desc_act else ''}{'' if self.sym else ', asymmetric'})"


class GPTQFormat(CheckpointFormat):
    """Every linear layer of the decoder quantized, the LM head when `lm_head` says so; not modules_to_not_convert
    (substrings), nor those transformers' modules_in_block_to_quantize leaves out; GPTQModel's `dynamic`: "-:regex"
    skips a module, another regex overrides its settings."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.base = self.read_scheme(config)
        self.skip = list(config.get("modules_to_not_convert") or [])
        self.in_block = [n for names in config.get("modules_in_block_to_quantize") or [] for n in names]
        self.dynamic = dict(config.get("dynamic") or {})

    @staticmethod
    def read_scheme(config: dict) -> GPTQScheme:
        bits = setting(config, "bits", "w_bit", default=4)
        if bits != 4:
            raise unsupported("GPTQ bits", bits, (4,))
        fmt = str(setting(config, "checkpoint_format", "format", default="gptq")).lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise unsupported("GPTQ checkpoint_format", fmt, CHECKPOINT_FORMATS)
        return GPTQScheme(
            group_size=check_group(setting(config, "group_size", default=128), "GPTQ"),
            sym=bool(setting(config, "sym", default=True)),
            desc_act=bool(setting(config, "desc_act", default=False)),
            zeros_minus_one=fmt == "gptq",
        )

    def scheme(self, name):
        if name == "lm_head" and not self.config.get("lm_head"):
            return None
        if any(key in name for key in self.skip):
            return None
        if self.in_block and name != "lm_head" and not any(name.endswith(f".{n}") for n in self.in_block):
            return None
        for pattern, overrides in self.dynamic.items():
            if re.match(pattern.removeprefix("-:").removeprefix("+:"), name):
                return None if pattern.startswith("-:") else self.read_scheme({**self.config, **overrides})
        return self.base

    def method(self, scheme, prefix, shard_names):
        return GPTQMethod(scheme, prefix, shard_names)

    def describe(self) -> str:
        return f"gptq {self.base}"


class GPTQMethod(CheckpointInt4):
    """Per linear layer: qweight int32 [I / 8, O] (nibble k of word r is input 8r + k), qzeros int32 [I / G, O / 8]
    (nibble k of word c is output 8c + k), scales fp16 [I / G, O], g_idx int32 [I] (each input's group):
    W[o, i] = scales[g, o] * (q[o, i] - z[g, o]) with g = g_idx[i]."""

    name = "gptq"

    def tensors(self, in_f, out_f):
        group = in_f if self.scheme.group_size == -1 else self.scheme.group_size
        groups = in_f // group
        return {
            "qweight": TensorSpec((in_f // 8, out_f), (torch.int32,), out_dim=1),
            "qzeros": TensorSpec((groups, -(-out_f // 8)), (torch.int32,), out_dim=1),
            "scales": TensorSpec((groups, out_f), FLOATS, out_dim=1),
            # some writers leave it out when the inputs are in order; -1 marks it absent
            "g_idx": TensorSpec((in_f,), (torch.int32, torch.int64), out_dim=None, optional=True, fill=-1),
        }

    def convert(self, t, in_f, out_f, name):
        group = in_f if self.scheme.group_size == -1 else self.scheme.group_size
        q = unpack_int32(t["qweight"], 4, dim=0)  # [I, O]
        words = t["qzeros"].to(torch.int64)
        if self.scheme.zeros_minus_one:
            words = words + V1_ZERO_OFFSETS  # with the carries GPTQModel's v1 -> v2 conversion has
        zero = unpack_int32(words, 4, dim=1, size=out_f)  # [I / G, O]
        in_order = torch.arange(in_f, device=q.device) // group
        g_idx = t["g_idx"].to(torch.int64)
        if (g_idx == -1).all():
            g_idx = in_order
        perm = None
        if not torch.equal(g_idx, in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise ModelLoadError(f"{name}.g_idx does not give each of its groups {group} inputs")
            q = q[perm]
        return {"q": q.T.to(torch.uint8), "scale": t["scales"].T, "zero": zero.T, "group": group, "perm": perm}
