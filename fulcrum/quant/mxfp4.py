"""MXFP4 (the OCP microscaling format gpt-oss's experts are released in): blocks of 32 values, each a 4-bit e2m1
float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) with one shared E8M0
exponent per block (a uint8 e, the scale 2 ** (e - 127)), 4.25 bits per value.

The checkpoint stores a weight [..., rows, cols] as `*_blocks` uint8 [..., rows, cols / 32, 16] (two values a
byte, the even column in the low nibble) and `*_scales` uint8 [..., rows, cols / 32]. The engine keeps them so:
`linear` reads them with the CPU kernel (few rows) or dequantizes them (many rows, or no kernel); `quantize` makes
them (for tests and benchmarks)."""

from __future__ import annotations

import torch

from fulcrum.kernels import cpu_gemv, cpu_mxfp4

BLOCK = 32  # values per shared exponent
BITS_PER_VALUE = 4 + 8 / BLOCK  # the 4-bit value and its share of the block's exponent byte
E8M0_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: "
            f"blocks are [..., rows, cols / {BLOCK}, {BLOCK // 2}], scales [..., rows, cols / {BLOCK}]"
        )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., rows, G, 16] and scales [..., rows, G] -> the weight [..., rows, G * 32] in `dtype` (exact:
    every MXFP4 value is representable in bf16 and fp32 within their exponent range)."""
    check(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], -1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return values.flatten(-2).to(dtype)


# Up to this many rows the GEMV kernel reads the weight; beyond, the dequantized weight's matmul (a first choice)
MAX_KERNEL_ROWS = 16


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, I] @ W^T + bias for W [O, I] as blocks [O, I / 32, 16] and scales [O, I / 32]."""
    if x.dim() == 2 and x.shape[0] <= MAX_KERNEL_ROWS and cpu_mxfp4.usable(x, blocks, bias):
        return cpu_mxfp4.gemv(x, blocks, scales, bias)
    kernel = x.dtype in (torch.float32, torch.bfloat16) and cpu_mxfp4.usable(x, blocks)
    w = cpu_mxfp4.dequantize(blocks, scales, x.dtype) if kernel else dequantize(blocks, scales, x.dtype)
    return cpu_gemv.linear(x, w, bias)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., rows, cols] (cols a multiple of 32) -> (blocks, scales) as the checkpoints store them. Each
    block's exponent puts its largest magnitude at or below 6 (e2m1's largest); values round to the nearest
    e2m1 value (ties to the even code, as round-to-nearest-even does)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows in blocks of {BLOCK}; {weight.shape[-1]} columns is not a multiple")
    w = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = w.abs().amax(-1, keepdim=True)
    # smallest e with amax / 2^e <= 6; all-zero blocks take the smallest exponent
    exp = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / 6.0)).clamp(-E8M0_BIAS, 127)
    scaled = w / torch.exp2(exp)
    grid = torch.tensor(FP4_VALUES[:8], device=w.device)
    # nearest magnitude; ties go to the even code (the lower index on a tie when that index is even)
    dist = (scaled.abs().unsqueeze(-1) - grid).abs()
    best = dist.argmin(-1)
    tie = torch.isclose(dist.gather(-1, (best + 1).clamp(max=7).unsqueeze(-1)).squeeze(-1), dist.amin(-1))
    best = torch.where(tie & (best % 2 == 1) & (best < 7), best + 1, best)
    codes = (best | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    scales = (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
    return blocks, scales
