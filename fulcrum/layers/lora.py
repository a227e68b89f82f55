"""LoRA in the linear layers: every targeted layer holds `max_loras` adapter slots, and one step's tokens each name a
slot (or none: the base model). The layer adds  scale * B_slot (A_slot x)  to its base output for each token:

- A of every slot stacked as [slots, shards * max_rank, in] (a packed layer's shards, q/k/v or gate/up, each with its
  own A), B as [slots, out, shards * max_rank], block-diagonal over the shards, the adapter's scaling folded in;
  a rank below max_rank and an untargeted shard are zeros;
- few tokens (decode steps): each token's A and B gathered and applied in two batched matmuls, no loop;
- many tokens (prefill): tokens grouped by slot, two matmuls per adapter present in the step.

The step's token -> slot map is set once per step by the engine (`set_step`), as the attention metadata is."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# at or below this many tokens a step gathers each token's matrices; above, it groups tokens by adapter
GATHER_MAX_TOKENS = 64


@dataclass
class StepLoRA:
    """One step's adapters: each token's slot (-1: none), and per slot present the rows that use it."""

    slots: torch.Tensor  # [T] long
    groups: list[tuple[int, torch.Tensor]]  # (slot, rows [n] long)
    any_base: bool  # some token uses no adapter


_step: StepLoRA | None = None


def set_step(token_slots: list[int] | None, device: torch.device) -> None:
    """The token -> slot map of the step about to run (None: no token uses an adapter)."""
    global _step
    if not token_slots or all(s < 0 for s in token_slots):
        _step = None
        return
    slots = torch.tensor(token_slots, dtype=torch.long)
    groups = []
    for s in sorted(set(token_slots) - {-1}):
        groups.append((s, (slots == s).nonzero().flatten().to(device)))
    _step = StepLoRA(slots.to(device), groups, bool((slots < 0).any()))


def active() -> bool:
    return _step is not None


class LoRASlots(nn.Module):
    """A linear layer's adapter slots. `out_sizes`: the layer's output shards (one for a plain layer)."""

    def __init__(self, max_loras: int, max_rank: int, in_size: int, out_sizes: list[int], dtype, device=None):
        super().__init__()
        self.max_rank, self.out_sizes = max_rank, list(out_sizes)
        r = max_rank * len(out_sizes)
        # slot max_loras is all zeros: the gathered path's "no adapter"
        self.register_buffer("a", torch.zeros(max_loras + 1, r, in_size, dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "b", torch.zeros(max_loras + 1, sum(out_sizes), r, dtype=dtype, device=device), persistent=False
        )

    def set_slot(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Put an adapter in `slot`: per output shard its (A [r, in], B [out_shard, r]) or None (not targeted)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        R, offset = self.max_rank, 0
        for i, (size, ab) in enumerate(zip(self.out_sizes, shards)):
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                self.a[slot, i * R : i * R + r].copy_(a)
                self.b[slot, offset : offset + size, i * R : i * R + r].copy_(b.float() * scaling)
            offset += size

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each token's adapter delta (x: [T, in], out: [T, out])."""
        step = _step
        if step is None or x.shape[0] != step.slots.shape[0]:
            return out
        if x.shape[0] <= GATHER_MAX_TOKENS:
            idx = torch.where(step.slots < 0, self.a.shape[0] - 1, step.slots)
            xa = torch.bmm(self.a[idx], x.unsqueeze(2))  # [T, r, 1]
            return out + torch.bmm(self.b[idx], xa).squeeze(2).to(out.dtype)
        out = out.clone() if out.requires_grad else out
        for slot, rows in step.groups:
            xs = x.index_select(0, rows)
            delta = (xs @ self.a[slot].t()) @ self.b[slot].t()
            out.index_add_(0, rows, delta.to(out.dtype))
        return out
