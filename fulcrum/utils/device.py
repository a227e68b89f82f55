"""Host values onto a device without waiting for the work queued there."""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values on `device`: on CUDA through pinned memory and an asynchronous copy (a copy from pageable memory waits
    for everything queued before it, which would stall async scheduling behind the step in flight). The caching
    host allocator keeps the pinned buffer until the copy is done."""
    host = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
