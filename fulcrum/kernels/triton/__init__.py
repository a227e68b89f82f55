"""Triton kernels for the GPU path: paged attention (decode, varlen prefill), rotary with the KV-cache write, RMSNorm
with the residual add. Each has a PyTorch reference in its tests; without CUDA they run under Triton's interpreter
(TRITON_INTERPRET=1, set here before any kernel is defined), which is how `make test` checks them on CPU."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

if not torch.cuda.is_available():
    # triton.jit reads this when a kernel is defined: on a machine without CUDA the interpreter is the only way to
    # run them (slowly, on CPU tensors), so the modules below define interpreted kernels there
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKEND_ENV = "FULCRUM_ATTENTION_BACKEND"  # "triton" forces these kernels (on CPU: interpreted), "torch" refuses them


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(x: torch.Tensor) -> bool:
    """Whether a layer should run its Triton kernel on `x` (see `usable_on`)."""
    return usable_on(x.device)


def usable_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device`: on CUDA unless the backend is set to torch; on CPU only when it is
    forced to triton (the interpreter: a correctness path, far slower than the CPU kernels)."""
    backend = os.environ.get(BACKEND_ENV, "")
    if device.type == "cuda":
        return backend != "torch" and available()
    return backend == "triton" and device.type == "cpu" and interpreted() and available()
