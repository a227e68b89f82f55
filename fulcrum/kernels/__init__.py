"""fulcrum's own kernels, picked at runtime by ISA (`cpu_ext.isa()`): decode attention over the paged KV cache and
a GEMV for few-row linear layers, RMSNorm and greedy decoding's argmax, on AVX2 and AVX-512 (each built once per environment by
`cpu_ext`), a driver that runs a decode step's whole decoder stack through them in one call.
Layers call them and fall back to PyTorch ops."""

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
    cpu_qgemv,
    cpu_qgemv_vnni,
    cpu_rope,
)

__all__ = ["warm_up"]


def warm_up(device: str | torch.device, quantized: bool = False, quantized_kv: bool = False) -> None:
    """Build or load every kernel `device` runs on now (about 10 s the first time in an environment on 2 cores,
    the builds side by side), so a server reports ready with them in place instead of building them in the middle
    of the first request."""
    if torch.device(device).type != "cpu":
        return
    kernels = (cpu_act, cpu_argmax, cpu_attention, cpu_decode_stack, cpu_gemv, cpu_norm, cpu_rope) + (
        (cpu_qgemv, cpu_qgemv_vnni) if quantized else ()
    )
    builds = [k.available for k in kernels] + ([lambda: cpu_attention.available(True)] if quantized_kv else [])
    with ThreadPoolExecutor(max_workers=len(builds)) as pool:  # each build is a compiler process: threads suffice
        list(pool.map(lambda build: build(), builds))
