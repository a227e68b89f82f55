"""CUDA graphs for decode steps: the forward and the LM head captured once per batch-size bucket over static input
buffers, then replayed, so that a decode step costs one launch instead of a few hundred kernel launches from Python.
A step is padded up to its bucket (padding rows write no KV and read none); prefill and mixed steps run eagerly."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fulcrum.engine.step_inputs import StepInputs
from fulcrum.layers.attention import Attention, AttentionMetadata
from fulcrum.utils.device import to_device

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to max_num_seqs (itself included), as vLLM buckets."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows; None when n is larger than all of them."""
    return next((s for s in sizes if s >= n), None)


def graphable(si: StepInputs) -> bool:
    """A step of single-token decodes only, whose logits are every row's in order: what a captured graph computes."""
    n = len(si.ids)
    return (
        n > 0
        and not si.prefills
        and len(si.decode_idx) == n
        and si.num_prompt_rows == 0
        and si.logits_rows == list(range(n))
    )


@dataclass
class PaddedDecode:
    """A decode step's inputs padded to `size` rows, as plain lists (what the static buffers receive): padding rows
    have slot -1 (their KV is not written), context length 0 (nothing read) and token 0."""

    size: int
    ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


def pad(si: StepInputs, size: int) -> PaddedDecode:
    extra = size - len(si.ids)
    return PaddedDecode(
        size,
        si.ids + [0] * extra,
        si.positions + [0] * extra,
        si.slots + [-1] * extra,
        si.decode_ctx + [0] * extra,
        si.decode_tables + [[]] * extra,
    )


def supported(model: torch.nn.Module) -> str | None:
    """Why the model's decode steps cannot be captured, or None when they can: every attention layer must be plain
    paged attention on the Triton kernels (no host syncs, padding rows skipped)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        return "the model has no paged attention layers"
    kinds = {type(m).__name__ for m in layers if type(m) is not Attention}
    if kinds:
        return f"its attention layers ({', '.join(sorted(kinds))}) are not captured"
    return None


class DecodeGraphs:
    """Captured decode steps of one model: static buffers for max(sizes) rows and max_blocks blocks per row, one
    graph per size sharing a memory pool (captured largest first, so the smaller ones reuse its memory)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, sizes: list[int], max_blocks: int):
        self.model, self.device, self.sizes, self.max_blocks = model, device, sorted(sizes), max_blocks
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=[1] * size,
            slot_mapping=self.slots[:size],
            decode_token_idx=torch.arange(size, device=self.device),
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            decode_max_context=self.max_blocks,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.ids[:size], self.positions[:size], self._meta(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # once eagerly: Triton compiles and autotunes outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[size] = self._forward(size)
                self.graphs[size] = graph
                self.pool = graph.pool()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def fits(self, si: StepInputs) -> bool:
        return (
            graphable(si)
            and bucket(len(si.ids), self.sizes) is not None
            and max(len(t) for t in si.decode_tables) <= self.max_blocks
        )

    def load(self, si: StepInputs) -> int:
        """Copy this step's inputs, padded to its bucket, into the static buffers (one host-to-device copy); the
        bucket. Only the block-table columns in use are copied: those past a row's context are never read."""
        size = bucket(len(si.ids), self.sizes)
        p = pad(si, size)
        width = max(len(t) for t in p.block_tables)
        tables = [b for t in p.block_tables for b in (*t, *[0] * (width - len(t)))]
        flat = to_device([*p.ids, *p.positions, *p.slots, *p.context_lens, *tables], self.device, torch.long)
        parts = flat.split([size, size, size, size, size * width])
        for dst, src in zip((self.ids, self.positions, self.slots, self.context_lens), parts[:4]):
            dst[:size].copy_(src)
        self.block_tables[:size, :width].copy_(parts[4].view(size, width))
        return size

    def run(self, si: StepInputs, in_flight: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the bucket's graph on this step's inputs; its logits [rows, vocab]. `in_flight`: (rows, token ids
        on the device) of tokens the step before is still sampling (async scheduling)."""
        size = self.load(si)
        if in_flight is not None:
            self.ids[in_flight[0]] = in_flight[1]
        self.graphs[size].replay()
        return self.logits[size][: len(si.ids)]

    def run_eagerly(self, si: StepInputs) -> torch.Tensor:
        """What the replay computes, run as plain calls on the same padded static buffers (any device: the tests
        check the padding and buffers this way on CPU, where nothing can be captured)."""
        size = self.load(si)
        return self._forward(size)[: len(si.ids)]
