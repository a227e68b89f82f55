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


# A linear's second copies of its weight in fulcrum's own layout (kernels/cpu_prepack.py: `packed_weight`, and at AMX
# `small_weight`), held as plain attributes: the copies a decode step of several rows streams, so they go to the
# region too (oneDNN's opaque packed tensors stay where oneDNN put them)
PACKED_ATTRS = ("packed_weight", "small_weight")


def move_parameters_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` (a quantized layer's packed weights are buffers), and each
    linear's packed copies in fulcrum's layout (PACKED_ATTRS), into one huge-page region, module by module in
    registration order (the order a forward reads them); tied parameters stay tied. Returns the bytes moved."""
    tensors, seen = [], set()  # (the dict that holds it: a module's parameters, buffers or attributes; its name)
    for module in model.modules():
        places = [(module._parameters, n) for n in module._parameters] + [(module._buffers, n) for n in module._buffers]
        places += [(module.__dict__, n) for n in PACKED_ATTRS if n in module.__dict__]
        for table, name in places:
            t = table[name]
            cpu = isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
            if cpu and t.numel() and id(t) not in seen:
                seen.add(id(t))
                tensors.append((table, name))
    offsets, total = [], 0
    for table, name in tensors:
        t = table[name]
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not total:
        return 0
    arena = huge_page_bytes(total)
    for (table, name), off in zip(tensors, offsets):
        t = table[name]
        nbytes = t.numel() * t.element_size()
        new = arena[off : off + nbytes].view(t.dtype).view(t.shape)
        new.copy_(t.detach())
        if isinstance(t, nn.Parameter):
            t.data = new
        else:
            table[name] = new
    return total
