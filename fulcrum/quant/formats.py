"""Weight-only quantization as pure tensor functions: quantize, pack, and dequantize back (the reference every
kernel and test is held to). Formats as `fulcrum.kernels.cpu_qgemv` reads them."""

from __future__ import annotations

import torch

from fulcrum.config import INT4_GROUP_SIZES  # noqa: F401  (the group sizes the int4 format takes)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [O, I] int8 in -127..127, scale [O] fp32), W ~ q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one fp32 scale per output channel: (q [O, I] float8_e4m3fn, scale [O]), W ~ q * scale. A
    per-tensor scale (as some checkpoints store) is the same with every channel's scale equal."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one fp32 scale per [block[0], block[1]] tile (the last ones cut short where a size is not a
    multiple), as DeepSeek-V3 and Qwen3-FP8 checkpoints store them: (q [O, I] float8_e4m3fn, scale_inv
    [ceil(O / b0), ceil(I / b1)]), W ~ q * scale_inv of its tile. For tests: such checkpoints come quantized."""
    out_f, in_f = w.shape
    rows, cols = block
    scale = torch.empty(-(-out_f // rows), -(-in_f // cols), dtype=torch.float32)
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            s = tile.abs().amax().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (tile / s).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q, scale


def fp8_block_rows(scale_inv: torch.Tensor, block_rows: int, out_f: int) -> torch.Tensor:
    """[ceil(O / b0), n] tile scales -> [O, n]: each weight row's scale per block of inputs (exact: a row's scales
    are its tile row's)."""
    return scale_inv.float().repeat_interleave(block_rows, dim=0)[:out_f]


def dequantize_fp8_groups(q: torch.Tensor, scales: torch.Tensor, block_cols: int) -> torch.Tensor:
    """q [O, I] float8_e4m3fn with scales [O, ceil(I / b1)], one per row and block of inputs -> fp32 [O, I]."""
    out_f, in_f = q.shape
    blocks = scales.shape[1]
    w = q.float()
    if blocks * block_cols != in_f:  # the last block is cut short
        w = torch.nn.functional.pad(w, (0, blocks * block_cols - in_f))
    w = (w.view(out_f, blocks, block_cols) * scales[..., None]).view(out_f, -1)
    return w if w.shape[1] == in_f else w[:, :in_f].contiguous()


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-wise fp8 checkpoint tensor (quantize_fp8_blocks' layout) as fp32 [O, I]."""
    return dequantize_fp8_groups(q, fp8_block_rows(scale_inv, block[0], q.shape[0]), block[1])


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (a zero point per group, as GPTQ and AWQ store it): q in 0..15 with
    W ~ q * scale + offset per group of `group_size` inputs. Returns (packed [O, I/2] uint8, scale, offset [O, I/G])."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)  # the range holds 0, so zero stays exact
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(out_f, in_f)), scale, -zero * scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[O, I] values 0..15 -> [O, I/2] bytes: in each 32 values, byte j = value j | value (j + 16) << 4."""
    out_f, in_f = q.shape
    c = q.to(torch.uint8).reshape(out_f, in_f // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(out_f, in_f // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out_f, half = packed.shape
    b = packed.reshape(out_f, half // 16, 16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(out_f, half * 2)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """offset None: the zero point 8 (GGUF's Q4_0), offset = -8 * scale."""
    q = unpack_int4(packed).float()
    out_f, in_f = q.shape
    g = q.reshape(out_f, scale.shape[1], -1)
    if offset is None:
        offset = -8 * scale
    return (g * scale[..., None] + offset[..., None]).reshape(out_f, in_f)


def quantize_int8g(w: torch.Tensor, group_size: int, offset: bool = False):
    """int8 in groups of `group_size` inputs (16 or 32; the layout GGUF's Q8_0, Q5_*, Q6_K ... load into): symmetric
    (q in -127..127, W ~ q * scale), or with an offset per group (q in -128..127 over the group's range). Returns
    (q [O, I] int8, scale [O, I/G], offset [O, I/G] or None). For tests: GGUF files come quantized."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    if not offset:
        scale = g.abs().amax(-1).clamp(min=1e-12) / 127
        q = torch.round(g / scale[..., None]).clamp(-127, 127)
        return q.to(torch.int8).reshape(out_f, in_f), scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 255) - 128
    return q.to(torch.int8).reshape(out_f, in_f), scale, lo + 128 * scale


def dequantize_int8g(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    out_f, in_f = q.shape
    g = q.float().reshape(out_f, scale.shape[1], -1) * scale[..., None]
    if offset is not None:
        g = g + offset[..., None]
    return g.reshape(out_f, in_f)


# int5's fifth bits: per 64 values two uint32 words, bit k of word 0 for the value in byte k's low nibble of the
# 64 values' int4 packing (values 0-15, then 32-47), bit k of word 1 for byte k's high nibble (16-31, 48-63)
_INT5_LO = list(range(0, 16)) + list(range(32, 48))
_INT5_HI = list(range(16, 32)) + list(range(48, 64))


def pack_int5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] values 0..31 (I a multiple of 64) -> (int4 packing of the low 4 bits [O, I/2], fifth bits [O, I/8])."""
    out_f, in_f = q.shape
    q = q.to(torch.int64)
    bits = ((q >> 4) & 1).reshape(out_f, in_f // 64, 64)
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = torch.stack([(bits[..., _INT5_LO] * weights).sum(-1), (bits[..., _INT5_HI] * weights).sum(-1)], -1)
    high = words.numpy().astype("<u4").view("u1").reshape(out_f, in_f // 8)
    return pack_int4(q & 15), torch.from_numpy(high.copy())


def unpack_int5(packed: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    out_f, half = packed.shape
    words = torch.from_numpy(high.contiguous().numpy().view("<u4").astype("int64")).reshape(out_f, half // 32, 2)
    k = torch.arange(32, dtype=torch.int64)
    bits = torch.empty(out_f, half // 32, 64, dtype=torch.int64)
    bits[..., _INT5_LO] = (words[..., 0:1] >> k) & 1
    bits[..., _INT5_HI] = (words[..., 1:2] >> k) & 1
    return unpack_int4(packed).to(torch.int64) | (bits.reshape(out_f, half * 2) << 4)


def dequantize_int5(packed, high, scale, offset=None) -> torch.Tensor:
    """offset None: the zero point 16 (GGUF's Q5_0), offset = -16 * scale."""
    q = unpack_int5(packed, high).float()
    out_f, in_f = q.shape
    if offset is None:
        offset = -16 * scale
    return (q.reshape(out_f, scale.shape[1], -1) * scale[..., None] + offset[..., None]).reshape(out_f, in_f)
