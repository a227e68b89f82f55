"""CPU memory on transparent huge pages, for the weights and the KV cache: a decode step streams every weight once, and
on 4 KiB pages that stream takes a TLB miss every page. PyTorch's allocator asks for huge pages only when
THP_MEM_ALLOC_ENABLE is set before its first allocation, so these helpers map a region themselves and
`madvise(MADV_HUGEPAGE)` it; where THP is off the memory is ordinary pages, still correct.
"""

from __future__ import annotations

import contextlib
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def huge_page_bytes(nbytes: int, huge: bool = True) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary, backed by huge pages where
    the kernel grants them (ordinary pages, faulted in as first written, with `huge=False`). The tensor keeps the
    mapping alive."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off in this kernel: ordinary pages
            region.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE_PAGE
    return buf[start : start + nbytes]


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor on huge pages (anonymous mappings start zeroed); `huge=False`: ordinary pages."""
    n = 1
    for s in shape:
        n *= s
    return huge_page_bytes(n * dtype.itemsize, huge).view(dtype).view(shape)


def move_parameters_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` (a quantized layer's packed weights are buffers) into one
    huge-page region, module by module in registration order (the order a forward reads them); tied parameters stay
    tied. Returns the bytes moved."""
    tensors, seen = [], set()  # (module, name, is a parameter)
    for module in model.modules():
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is not None and t.device.type == "cpu" and t.numel() and id(t) not in seen:
                    seen.add(id(t))
                    tensors.append((module, name, kind))
    offsets, total = [], 0
    for module, name, kind in tensors:
        t = (module._parameters if kind else module._buffers)[name]
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not total:
        return 0
    arena = huge_page_bytes(total)
    for (module, name, kind), off in zip(tensors, offsets):
        table = module._parameters if kind else module._buffers
        t = table[name]
        nbytes = t.numel() * t.element_size()
        new = arena[off : off + nbytes].view(t.dtype).view(t.shape)
        new.copy_(t.data)
        if kind:
            t.data = new
        else:
            table[name] = new
    return total
