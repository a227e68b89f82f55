"""AWQ checkpoints (AutoAWQ's GEMM version, transformers' AwqConfig), 4-bit with zero points. Per linear layer:
qweight int32 [I, O / 8] and qzeros int32 [I / G, O / 8], both packed along the outputs in AWQ's order (nibble k of
word c is output 8c + ORDER[k]), scales fp16 [I / G, O]: W[o, i] = scales[g, o] * (q[o, i] - z[g, o]), g = i / G.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
UNDO_ORDER = tuple(sorted(range(8), key=ORDER.__getitem__))  # output 8c + j is nibble UNDO_ORDER[j]
VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AWQScheme:
    group_size: int

    def __str__(self) -> str:
        return "int4 (per channel)" if self.group_size == -1 else f"int4 (group {self.group_size})"


class AWQFormat(CheckpointFormat):
    """Every linear layer of the decoder quantized but modules_to_not_convert (substrings of module names); the
    LM head never."""

    def __init__(self, config: dict):
        super().__init__(config)
        bits = setting(config, "bits", "w_bit", default=4)
        if bits != 4:
            raise unsupported("AWQ bits", bits, (4,))
        version = str(setting(config, "version", default="gemm")).lower()
        if version not in VERSIONS:
            raise unsupported("AWQ version", version, VERSIONS)
        if not setting(config, "zero_point", default=True):
            raise unsupported("AWQ zero_point", False, (True,))
        self.base = AWQScheme(check_group(setting(config, "group_size", "q_group_size", default=128), "AWQ"))
        self.skip = list(config.get("modules_to_not_convert") or [])

    def scheme(self, name):
        if name == "lm_head" or any(key in name for key in self.skip):
            return None
        return self.base

    def method(self, scheme, prefix, shard_names):
        return AWQMethod(scheme, prefix, shard_names)

    def describe(self) -> str:
        return f"awq {self.base}"


def unpack_awq(words: torch.Tensor, out_f: int) -> torch.Tensor:
    """[R, O / 8] int32 in AWQ's order -> [R, O] values 0..15 in output order."""
    q = unpack_int32(words, 4, dim=1)
    q = q.reshape(q.shape[0], -1, 8)[..., list(UNDO_ORDER)]
    return q.reshape(q.shape[0], -1)[:, :out_f]


class AWQMethod(CheckpointInt4):
    name = "awq"

    def tensors(self, in_f, out_f):
        groups = 1 if self.scheme.group_size == -1 else in_f // self.scheme.group_size
        words = -(-out_f // 8)
        return {
            "qweight": TensorSpec((in_f, words), (torch.int32,), out_dim=1),
            "qzeros": TensorSpec((groups, words), (torch.int32,), out_dim=1),
            "scales": TensorSpec((groups, out_f), FLOATS, out_dim=1),
        }

    def convert(self, t, in_f, out_f, name):
        return {
            "q": unpack_awq(t["qweight"], out_f).T.to(torch.uint8),
            "scale": t["scales"].T,
            "zero": unpack_awq(t["qzeros"], out_f).T,
            "group": self.scheme.group_size,
        }
