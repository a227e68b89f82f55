"""GGUF's block formats (llama.cpp's Q8_0, Q4_0, Q4_K ...) kept in their bits: each tensor is converted at load,
without loss, into the layout of a kernel that reads it, and each tensor of a file keeps its own format (a Q4_K_M
file's Q6_K tensors stay 6-bit values beside its Q4_K ones).

    GGML type       values per group   fulcrum layout (fulcrum.kernels.cpu_qgemv)          bits/weight: file -> held
    Q4_0            32                 int4, scale per 32 (fp32; zero point 8)             4.5 -> 5
    Q4_1 Q4_K       32                 int4, scale and offset per 32 (fp32)                5 / 4.5 -> 6
    Q5_0            32                 int5 (int4's nibbles and a bit plane), a scale per  5.5 -> 6
                                       32 (zero point 16)
    Q5_1 Q5_K       32                 int5, a scale and an offset per 32                  6 / 5.5 -> 7
    Q8_0            32                 int8 in groups of 32, a scale each                  8.5 -> 9
    Q6_K Q3_K       16                 int8 in groups of 16, a scale each                  6.6 / 3.4 -> 10
    Q2_K            16                 int8 in groups of 16, a scale and an offset each    2.6 -> 12
    F32 F16 BF16    -                  dense, in the model's dtype

(int5 takes rows of whole 64s: other Q5 rows are held as int8 groups, 9-10 bits.)

Exact: every weight the kernels compute with is q * scale + offset with q the file's integer and scale / offset the
fp32 products the file's dequantization forms (d * sub-block scale, -dmin * sub-block min), so the weights equal
gguf's (llama.cpp's) dequantized values up to float32 rounding. The scales are held in fp32 (the K-quants' products of
an fp16 and a 6-bit integer need up to 17 bits), which is what the held size adds over the file's. Other block types
(IQ*, TQ*, MXFP4 ...) are dequantized at load into the dense layout, said once by name at load.

Linear layers of a quantized file get GGUFLinearMethod: a stacked layer (q/k/v, gate/up) holds one part per run of
shards in the same layout, each computed by its kernel. The embedding keeps a quantized table too and dequantizes
only the rows of a step's tokens (fulcrum.layers.embedding)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fulcrum.errors import ModelLoadError, WeightLoadError, WeightShapeError
from fulcrum.kernels import cpu_qgemv, cpu_qgemv_vnni
from fulcrum.quant import formats
from fulcrum.quant.base import LinearMethod, UnquantizedLinearMethod
from fulcrum.quant.online import Int4Method, OnlineQuantMethod

log = logging.getLogger(__name__)

# type -> (layout, group size, offset): what each block type converts to
LAYOUTS = {
    "Q4_0": ("int4", 32, False),  # its offset is -8 x its scale: the kernels take it so, unstored
    "Q4_1": ("int4", 32, True),
    "Q4_K": ("int4", 32, True),
    "Q8_0": ("int8g", 32, False),
    "Q5_0": ("int5", 32, False),  # zero point 16, unstored
    "Q5_1": ("int5", 32, True),
    "Q5_K": ("int5", 32, True),
    "Q6_K": ("int8g", 16, False),
    "Q3_K": ("int8g", 16, False),
    "Q2_K": ("int8g", 16, True),
}


def layout_of(ggml_type: str, inputs: int) -> tuple[str, int, bool]:
    """(layout, group, offsets stored) for a tensor of this type with `inputs` values a row: int5's bit planes take
    rows of whole 64s, other 5-bit rows go to int8 groups (their integers as they are, Q5_0's signed)."""
    layout, group, has_offset = LAYOUTS[ggml_type]
    if layout == "int5" and inputs % 64:
        return "int8g", group, has_offset
    return layout, group, has_offset


# Rows converted at a time: the values of one chunk are dequantized by gguf to recover the integers, so this bounds
# the float32 copy a large tensor (a 150k-row vocabulary) needs at load
CHUNK_VALUES = 1 << 22


@dataclass
class GGUFRaw:
    """A block-quantized tensor as the file stores it: its bytes (a view of the memory-mapped file), GGML type, shape
    in torch's order ([rows, inputs]), GGUF name, and the order to take its rows in (None: as stored)."""

    data: np.ndarray
    ggml_type: str
    shape: tuple[int, ...]
    name: str
    rows: torch.Tensor | None = None


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


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of scales -> the 8 sub-blocks' 6-bit (scale, min): the first four in the low 6 bits of
    bytes 0-3 and 4-7, the last four in the nibbles of bytes 8-11 with their top 2 bits in those bytes' top bits."""
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q3k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 signed 6-bit scales: low nibbles in bytes 0-7 (scale j and j + 8), the top 2 bits in
    bytes 8-11 (scale 4i + k in bits 2i of byte 8 + k), stored with a bias of 32."""
    low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)
    high = np.concatenate([(s[:, 8:12] >> (2 * i)) & 3 for i in range(4)], axis=1)
    return ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)


def group_scales(ggml_type: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per block, each group's scale and offset (fp32 [n, groups], offset None where the type has none): W = q *
    scale + offset for the type's integers q (signed for Q8_0, Q5_0, Q6_K, Q3_K; 0..2^bits-1 for the others, which
    int8 holds as they are), as the type's dequantization forms them."""
    if ggml_type in ("Q8_0", "Q5_0"):
        return _f16(blocks, 0), None
    if ggml_type == "Q4_0":  # W = (q - 8) d: the int4 kernels' zero point 8 when no offsets are given
        return _f16(blocks, 0), None
    if ggml_type in ("Q4_1", "Q5_1"):
        return _f16(blocks, 0), _f16(blocks, 2)
    if ggml_type in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales(blocks[:, 4:16])
        return _f16(blocks, 0) * sc, -(_f16(blocks, 2) * mn)
    if ggml_type == "Q6_K":
        return _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32), None
    if ggml_type == "Q3_K":
        return _f16(blocks, 108) * _q3k_scales(blocks[:, 96:108]), None
    if ggml_type == "Q2_K":
        s = blocks[:, 0:16]
        return _f16(blocks, 80) * (s & 15).astype(np.float32), -(_f16(blocks, 82) * (s >> 4).astype(np.float32))
    raise ValueError(ggml_type)


def _integers(ggml_type: str, blocks: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """The integer behind every value of the blocks ([n, values per block] int16): read from the bytes where the
    layout is the kernel's own (Q8_0, Q4_0, Q4_1), else recovered from gguf's dequantized values, which are
    q * scale + offset exactly enough that rounding (W - offset) / scale gives q back (groups of scale 0 take 0)."""
    from gguf import GGMLQuantizationType, dequantize

    if ggml_type == "Q8_0":
        return blocks[:, 2:34].view(np.int8).astype(np.int16)
    if ggml_type in ("Q4_0", "Q4_1"):
        qs = blocks[:, 2 if ggml_type == "Q4_0" else 4 :]
        return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16)
    w = dequantize(blocks, GGMLQuantizationType[ggml_type]).reshape(blocks.shape[0], scale.shape[1], -1)
    if offset is not None:
        w = w - offset[..., None]
    safe = np.where(scale == 0, 1, scale)[..., None]
    q = np.rint(w / safe)
    q[np.broadcast_to(scale[..., None] == 0, q.shape)] = 0
    return q.reshape(blocks.shape[0], -1).astype(np.int16)


def convert(raw: GGUFRaw) -> dict[str, torch.Tensor]:
    """A block-quantized 2-D tensor in its fulcrum layout: {"qweight", "scales"[, "offsets"]} (int4: packed [O, I/2]
    uint8 of q in 0..15; int8g: [O, I] int8) with fp32 scales/offsets [O, I/G], rows in `raw.rows` order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rows, inputs = raw.shape
    layout, group, has_offset = layout_of(raw.ggml_type, inputs)
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[raw.ggml_type]]
    if inputs % per_block:
        raise WeightLoadError(f"GGUF tensor {raw.name}: {inputs} inputs are not whole {raw.ggml_type} blocks")
    blocks = raw.data.reshape(rows * (inputs // per_block), block_bytes)
    nibbles = layout in ("int4", "int5")
    q_out = torch.empty(rows, inputs // 2 if nibbles else inputs, dtype=torch.uint8 if nibbles else torch.int8)
    high = torch.empty(rows, inputs // 8, dtype=torch.uint8) if layout == "int5" else None
    scales = torch.empty(rows, inputs // group, dtype=torch.float32)
    offsets = torch.empty(rows, inputs // group, dtype=torch.float32) if has_offset else None
    step = max(1, CHUNK_VALUES // inputs)
    nb = inputs // per_block
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        b = np.ascontiguousarray(blocks[r0 * nb : r1 * nb])
        scale, offset = group_scales(raw.ggml_type, b)
        bad = ~np.isfinite(scale).all(1) if offset is None else ~(np.isfinite(scale) & np.isfinite(offset)).all(1)
        if bad.any():  # an fp16 field of inf or NaN: no weight of it can be computed with
            row = r0 + int(np.argmax(bad)) // nb
            raise WeightLoadError(
                f"GGUF tensor {raw.name} ({raw.ggml_type}) is corrupt: a block of row {row} has a scale that is not "
                "a finite number"
            )
        q = _integers(raw.ggml_type, b, scale, offset)
        q = torch.from_numpy(q).reshape(r1 - r0, inputs)
        if layout == "int4":
            q_out[r0:r1] = formats.pack_int4(q.to(torch.uint8))
        elif layout == "int5":
            q_out[r0:r1], high[r0:r1] = formats.pack_int5(q + 16 if offset is None else q)  # Q5_0: -16..15 held
        else:
            q_out[r0:r1] = q.to(torch.int8)
        scales[r0:r1] = torch.from_numpy(scale).reshape(r1 - r0, -1)
        if offsets is not None:
            offsets[r0:r1] = torch.from_numpy(offset).reshape(r1 - r0, -1)
    out = {"qweight": q_out, "scales": scales}
    if high is not None:
        out["qhigh"] = high
    if offsets is not None:
        out["offsets"] = offsets
    if raw.rows is not None:
        out = {k: v[raw.rows].contiguous() for k, v in out.items()}
    return out


class Int8GroupMethod(OnlineQuantMethod):
    """Dispatch for int8 in groups of `group_size` (scale and offset or none each): the online methods' choice of the
    widening GEMV, the integer-dot one, or a dequantized matmul, over cpu_qgemv's grouped int8 kernels."""

    name = "int8g"

    def __init__(self, group_size: int):
        self.group_size = group_size

    def dequantize(self, layer):
        return formats.dequantize_int8g(layer.qweight, layer.scales, layer.offsets)

    def dequantize_rows(self, layer, rows):
        offsets = None if layer.offsets is None else layer.offsets[rows]
        return formats.dequantize_int8g(layer.qweight[rows], layer.scales[rows], offsets)

    def vnni_usable(self, layer, x, bias):
        return cpu_qgemv_vnni.usable(x, bias, self.name)

    def gemv(self, layer, x, bias):
        if self.vnni_usable(layer, x, bias):
            return cpu_qgemv_vnni.int8g(x, layer.qweight, layer.scales, layer.offsets, self.group_size, bias)
        return cpu_qgemv.int8g(x, layer.qweight, layer.scales, layer.offsets, self.group_size, bias)

    def dequantize_fast(self, layer, dtype):
        return cpu_qgemv.dequantize_int8g(layer.qweight, layer.scales, layer.offsets, self.group_size, dtype)


class Int5Method(OnlineQuantMethod):
    """Dispatch for int5 (groups of 32; the fifth bits in `qhigh`), as Int8GroupMethod's."""

    name = "int5"
    group_size = 32

    def dequantize(self, layer):
        return formats.dequantize_int5(layer.qweight, layer.qhigh, layer.scales, layer.offsets)

    def dequantize_rows(self, layer, rows):
        offsets = None if layer.offsets is None else layer.offsets[rows]
        return formats.dequantize_int5(layer.qweight[rows], layer.qhigh[rows], layer.scales[rows], offsets)

    def vnni_usable(self, layer, x, bias):
        return cpu_qgemv_vnni.usable(x, bias, self.name)

    def gemv(self, layer, x, bias):
        if self.vnni_usable(layer, x, bias):
            return cpu_qgemv_vnni.int5(x, layer.qweight, layer.qhigh, layer.scales, layer.offsets, bias)
        return cpu_qgemv.int5(x, layer.qweight, layer.qhigh, layer.scales, layer.offsets, bias)

    def dequantize_fast(self, layer, dtype):
        return cpu_qgemv.dequantize_int5(layer.qweight, layer.qhigh, layer.scales, layer.offsets, dtype)


class DenseRows(UnquantizedLinearMethod):
    """A Part's float rows: the unquantized GEMV (a Part has no packed copy); dequantize for the references."""

    def dequantize(self, layer):
        return layer.weight.float()

    def dequantize_rows(self, layer, rows):
        return layer.weight[rows].float()


# Each layout's method (stateless: a Part holds the buffers, under the names the methods read); the int4 parts run
# through the online int4 method
METHODS = {
    ("dense", 0): DenseRows(),
    ("int4", 32): Int4Method(32),
    ("int5", 32): Int5Method(),
    ("int8g", 16): Int8GroupMethod(16),
    ("int8g", 32): Int8GroupMethod(32),
}


class Part(nn.Module):
    """Some rows of a layer's weight in one layout: `layout` int4 / int5 / int8g (buffers qweight[, qhigh], scales,
    offsets or None) or dense (buffer weight), computed by that layout's method (METHODS)."""

    def __init__(self, layout: str, group: int, tensors: dict[str, torch.Tensor], types: list[str]):
        super().__init__()
        self.layout, self.group_size, self.types = layout, group, types
        self.method = METHODS[layout, group]
        for k, v in tensors.items():
            self.register_buffer(k, v)
        if layout != "dense" and "offsets" not in tensors:
            self.register_buffer("offsets", None)  # int4: the zero point 8 (Q4_0); int5: 16 (Q5_0); int8g: symmetric
        self.rows = tensors["weight" if layout == "dense" else "qweight"].shape[0]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its rows `rows`) as fp32 [O, I]: the reference the kernels are held to."""
        return self.method.dequantize(self) if rows is None else self.method.dequantize_rows(self, rows)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, I] (2-D) @ W^T + bias."""
        return self.method.apply(self, x, bias)


def part_of(loaded, dtype: torch.dtype) -> tuple[str, int, dict[str, torch.Tensor], str]:
    """One loaded tensor (a GGUFRaw, or float values) as (layout, group, tensors, type name)."""
    if isinstance(loaded, GGUFRaw):
        if loaded.ggml_type in LAYOUTS:
            layout, group, _ = layout_of(loaded.ggml_type, loaded.shape[1])
            return layout, group, convert(loaded), loaded.ggml_type
        w = tensor_values(loaded.data, loaded.ggml_type, list(loaded.shape))
        if loaded.rows is not None:
            w = w[loaded.rows]
        held = w.to(dtype).contiguous()
        err = ((held.float() - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
        log.info("GGUF tensor %s: %s has no kernel here, dequantized to %s (largest error %.2g of its largest value)",
                 loaded.name, loaded.ggml_type, str(dtype).removeprefix("torch."), err)  # fmt: skip
        return "dense", 0, {"weight": held}, f"{loaded.ggml_type} (dequantized)"
    return "dense", 0, {"weight": loaded.to(dtype).contiguous()}, str(loaded.dtype).removeprefix("torch.")


def merge_parts(shards: list[tuple[str, int, dict, str]]) -> list[Part]:
    """Consecutive shards in the same layout (and group, and with offsets or not) stacked into one part."""
    parts: list[list] = []
    for layout, group, tensors, kind in shards:
        key = (layout, group, tuple(sorted(tensors)))
        if parts and parts[-1][0] == key:
            parts[-1][1].append(tensors)
            parts[-1][2].append(kind)
        else:
            parts.append([key, [tensors], [kind]])
    out = []
    for (layout, group, keys), tensors, kinds in parts:
        stacked = {k: torch.cat([t[k] for t in tensors]) if len(tensors) > 1 else tensors[0][k] for k in keys}
        out.append(Part(layout, group, stacked, kinds))
    return out


class GGUFLinearMethod(LinearMethod):
    """A linear layer (or LM head) whose weights come from a GGUF file: each checkpoint tensor (q, k, v ...) loads as
    the file stores it and converts to its layout; apply runs each part's kernel and joins their outputs."""

    from_checkpoint = True
    name = "gguf"

    def create_weights(self, layer, input_size, output_sizes, dtype):
        if getattr(layer, "tp_size", 1) > 1:
            raise ModelLoadError("GGUF files with tensor parallel > 1 are not supported yet")
        self.input_size, self.output_sizes, self.dtype = input_size, list(output_sizes), dtype
        self.shards: list = [None] * len(output_sizes)
        placeholder = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        placeholder.weight_loader = self.load
        placeholder.takes_gguf_raw = True
        layer.register_parameter("weight", placeholder)

    def load(self, param, loaded, shard_id=None) -> None:
        from fulcrum.quant.checkpoint import shard_index

        whole = (sum(self.output_sizes), self.input_size)
        if shard_id is None and len(self.output_sizes) > 1 and tuple(loaded.shape) == whole:
            self.shards = [part_of(loaded, self.dtype)]  # a checkpoint that stores the stack fused (Phi-3's)
            return
        index = shard_index(shard_id)
        expected = (self.output_sizes[index], self.input_size)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(expected, tuple(loaded.shape))
        self.shards[index] = part_of(loaded, self.dtype)

    def process_weights_after_loading(self, layer):
        if any(s is None for s in self.shards):  # the loader names what is missing before this runs
            raise WeightLoadError(f"{type(layer).__name__}: a GGUF shard was never loaded")
        del layer.weight
        layer.gguf_parts = nn.ModuleList(merge_parts(self.shards))
        self.shards = []
        layer.out_dtype = self.dtype

    def decode_stack_weight(self, layer):
        from fulcrum.kernels.cpu_decode_stack import Part as StackPart
        from fulcrum.kernels.cpu_decode_stack import QuantWeight

        kinds = {"dense": "DENSE", "int4": "INT4", "int8g": "INT8G", "int5": "INT5"}
        parts = [
            StackPart("DENSE", p.weight)
            if p.layout == "dense"
            else StackPart(kinds[p.layout], p.qweight, p.scales, p.offsets, p.group_size, getattr(p, "qhigh", None))
            for p in layer.gguf_parts
        ]
        return QuantWeight(parts, self.input_size, self.dtype)

    def apply(self, layer, x, bias):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        parts = layer.gguf_parts
        if len(parts) == 1:
            y = parts[0](x2, bias)
        else:
            y = torch.cat([p(x2, None) for p in parts], dim=-1)
            if bias is not None:
                y = y + bias
        return y.reshape(*lead, y.shape[-1])

    def dequantize(self, layer) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in layer.gguf_parts])

    def dequantize_rows(self, layer, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as fp32 (a tied embedding's lookup): a head is one tensor, so one part."""
        (part,) = layer.gguf_parts
        return part.dequantize(rows)


def gguf_factory():
    """Every linear layer and the LM head (tied or not: a tied head reads the embedding's tensor, the embedding
    then looks its rows up in the head's table) loads from the file as it stores them."""
    return lambda prefix: GGUFLinearMethod()


def describe(config: dict) -> str:
    """ "gguf (Q4_K x 120, Q6_K x 25, Q8_0 x 1)" from a GGUF folder's quantization_config."""
    types = config.get("types") or {}
    return "gguf (" + ", ".join(f"{t} x {n}" for t, n in types.items()) + ")"
