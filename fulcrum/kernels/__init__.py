"""fulcrum's own kernels. CPU (csrc/*.cpp, built and loaded by cpu_ext for this CPU's ISA): GEMV dense and quantized
(cpu_gemv, cpu_qgemv, cpu_qgemv_vnni), decode and prefill attention (cpu_attention), RMSNorm, rotary and cache write,
SwiGLU, argmax (cpu_norm, cpu_rope, cpu_act, cpu_argmax), the fused decode stack (cpu_decode_stack), and oneDNN's
prepacked matmul (cpu_prepack); GPU: triton/. Layers call them and fall back to PyTorch ops."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from fulcrum.kernels import (
    cpu_act,
    cpu_argmax,
    cpu_attention,
    cpu_decode_stack,
    cpu_gemv,
    cpu_norm,
    cpu_prepack,
    cpu_qgemv,
    cpu_qgemv_vnni,
    cpu_rope,
)

__all__ = ["warm_up"]


def warm_up(device: str | torch.device, quantized: bool = False, quantized_kv: bool = False) -> None:
    """Build or load every kernel `device` runs on now (seconds the first time in an environment, the builds side by
    side), so a server reports ready with them in place instead of building them in the middle of the first request."""
    if torch.device(device).type != "cpu":
        return
    kernels = (cpu_act, cpu_argmax, cpu_attention, cpu_decode_stack, cpu_gemv, cpu_norm, cpu_rope) + (
        (cpu_qgemv, cpu_qgemv_vnni) if quantized else ()
    )
    builds = [k.available for k in kernels] + ([lambda: cpu_attention.available(True)] if quantized_kv else [])
    builds.append(cpu_prepack.c_linear)  # the decode stack's ways to the packed weights (both layouts)
    with ThreadPoolExecutor(max_workers=len(builds)) as pool:  # each build is a compiler process: threads suffice
        list(pool.map(lambda build: build(), builds))
