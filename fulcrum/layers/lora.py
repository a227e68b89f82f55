"""LoRA in the linear layers: every targeted layer holds `max_loras` adapter slots, and one step's tokens each name a
slot (or none: the base model). The layer adds  scale * B_slot (A_slot x)  to its base output for each token:

- A of every slot stacked as [slots, shards * max_rank, in] (a packed layer's shards, q/k/v or gate/up, each with its
  own A); B transposed as [slots, out, max_rank], the adapter's scaling folded in; a rank below max_rank and an
  untargeted shard are zeros;
- runs of tokens of one adapter (a prompt's chunk, a step of one adapter): a shrink and an expand per shard for
  each run, on slices of the step's rows;
- scattered tokens (decode steps, one row per request): one shrink against the A of every slot in use at once, each
  token's part kept by a one-hot mask over the slots, then one expand per shard: no loop over adapters or rows,
  each adapter read once.

The step's token -> slot map is set once per step by the engine (`set_step`), as the attention metadata is."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# a step whose runs of one adapter's tokens average at least this many tokens is applied run by run; below, as one
# masked product over every slot in use
MIN_RUN_TOKENS = 16


@dataclass
class StepLoRA:
    """One step's adapters: each token's slot (-1: none), the slots in use (below `width`), the runs of consecutive
    tokens of one adapter, and the tokens' one-hot over the slots (by dtype, made once per step)."""

    slots: torch.Tensor  # [T] long
    width: int  # 1 + the highest slot in use
    runs: list[tuple[int, int, int]]  # (slot, start, end)
    by_runs: bool  # applied run by run (long runs), or masked
    onehot: dict[torch.dtype, torch.Tensor]

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        m = self.onehot.get(dtype)
        if m is None:
            m = self.onehot[dtype] = torch.nn.functional.one_hot(self.slots.clamp(min=0), self.width).to(dtype) * (
                self.slots >= 0
            ).unsqueeze(1).to(dtype)
        return m


_step: StepLoRA | None = None


def set_step(token_slots: list[int] | None, device: torch.device) -> None:
    """The token -> slot map of the step about to run (None: no token uses an adapter)."""
    global _step
    if not token_slots or all(s < 0 for s in token_slots):
        _step = None
        return
    runs: list[tuple[int, int, int]] = []
    for t, s in enumerate(token_slots):
        if runs and runs[-1][0] == s and runs[-1][2] == t:
            runs[-1] = (s, runs[-1][1], t + 1)
        elif s >= 0:
            runs.append((s, t, t + 1))
    slots = torch.tensor(token_slots, dtype=torch.long, device=device)
    by_runs = len(runs) * MIN_RUN_TOKENS <= len(token_slots)
    _step = StepLoRA(slots, max(token_slots) + 1, runs, by_runs, {})


def active() -> bool:
    return _step is not None


def token_slots() -> torch.Tensor | None:
    """The step's slot per token (-1: no adapter), int64, or None without adapters."""
    return None if _step is None else _step.slots


class LoRASlots(nn.Module):
    """A linear layer's adapter slots. `out_sizes`: the layer's output shards (one for a plain layer). A as
    [slots, shards * max_rank, in]; B twice: per shard as [slots, max_rank, shard's out] (the slots in use read as
    one [slots * max_rank, out] matrix by the masked product), and transposed as [slots, out, max_rank] (row o holds
    its shard's B row), the layout of a weight [out, in] that the CPU decode stack's GEMV reads
    (kernels/csrc/decode_stack.cpp)."""

    def __init__(self, max_loras: int, max_rank: int, in_size: int, out_sizes: list[int], dtype, device=None):
        super().__init__()
        self.max_rank, self.out_sizes = max_rank, list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.a = torch.zeros(max_loras, len(out_sizes) * max_rank, in_size, dtype=dtype, device=device)
        self.b = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for size in out_sizes]
        self.bt = torch.zeros(max_loras, sum(out_sizes), max_rank, dtype=dtype, device=device)

    def set_slot(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Put an adapter in `slot`: per output shard its (A [r, in], B [out_shard, r]) or None (not targeted)."""
        self.clear_slot(slot)
        R = self.max_rank
        for i, (off, size, ab) in enumerate(zip(self.offsets, self.out_sizes, shards)):
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                self.a[slot, i * R : i * R + r].copy_(a)
                scaled = b.float() * scaling
                self.b[i][slot, :r].copy_(scaled.t())
                self.bt[slot, off : off + size, :r].copy_(scaled)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each token's adapter delta (x: [T, in], out: [T, out]), in place."""
        step = _step
        if step is None or x.shape[0] != step.slots.shape[0]:
            return out
        T, R, S = x.shape[0], self.max_rank, len(self.out_sizes)
        x = x.to(self.a.dtype)
        if step.by_runs:
            for slot, start, end in step.runs:
                xa = x[start:end] @ self.a[slot].t()  # [n, S * R]
                for i, (off, size) in enumerate(zip(self.offsets, self.out_sizes)):
                    delta = xa[:, i * R : (i + 1) * R] @ self.b[i][slot]
                    out[start:end, off : off + size] += delta.to(out.dtype)
            return out
        w = step.width  # every slot in use at once, each token's own kept by the mask
        xa = x @ self.a[:w].reshape(w * S * R, -1).t()  # [T, w * S * R]
        xa = xa.view(T, w, S, R) * step.mask(xa.dtype)[:, :, None, None]
        for i, (off, size) in enumerate(zip(self.offsets, self.out_sizes)):
            # one product over the slots in use: [T, w * R] (other slots' parts zero) @ [w * R, size]
            delta = xa[:, :, i].reshape(T, w * R) @ self.b[i][:w].reshape(w * R, size)
            out[:, off : off + size] += delta.to(out.dtype)
        return out
