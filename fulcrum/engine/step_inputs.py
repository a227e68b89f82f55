"""One forward's inputs: a scheduler step flattened into token ids, positions, cache slots and the attention's
block tables, as plain lists (what rank 0 broadcasts to the other ranks of a parallel engine), then as tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from fulcrum.engine.scheduler import ScheduledRequest
from fulcrum.layers.attention import AttentionMetadata, PrefillSeq
from fulcrum.utils.device import to_device


@dataclass
class PromptLogprobSpan:
    """Rows [row, row + hi - lo) of a step's hidden states predict prompt tokens lo + 1 .. hi of `request_id`."""

    request_id: str
    row: int
    lo: int
    hi: int


@dataclass
class PoolSpan:
    """Rows [row, row + n) of a step's hidden states are prompt positions start .. start + n - 1 of the embedding
    request `request_id`; `last`: the prompt ends in this step."""

    request_id: str
    row: int
    n: int
    start: int
    last: bool
    pooling_type: str


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    prefill_tables: list[list[int]] = field(default_factory=list)
    decode_idx: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_ctx: list[int] = field(default_factory=list)
    # rows whose logits are computed, in this order: the prompt-logprob spans' rows, then the sampled rows (a sampling
    # request's last, or its last 1 + len(proposals) when it verifies some)
    logits_rows: list[int] = field(default_factory=list)
    num_prompt_rows: int = 0
    # not sent to other ranks: what rank 0 needs to read the logits back
    spans: list[PromptLogprobSpan] = field(default_factory=list)
    pool_spans: list[PoolSpan] = field(default_factory=list)  # embedding requests' rows, pooled by the runner
    last_idx: list[int] = field(default_factory=list)  # every request's last row
    # async scheduling: (row, request id) of the tokens still being sampled by the step in flight; their ids are
    # that step's sampled tokens, copied on the device (engine/model_runner.py), 0 here until then
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    # vision-language prompts (engine/multimodal.py): the rows of this step's image tokens and their embeddings
    # (a prefill chunk takes the slice of its image rows), and, when a request of the step has images, every
    # row's M-RoPE positions [3][rows] (a text request's three streams equal)
    image_rows: list[int] = field(default_factory=list)
    image_embeds: list = field(default_factory=list)
    mrope_positions: list[list[int]] | None = None

    def for_other_ranks(self) -> StepInputs:
        if self.placeholders:
            raise RuntimeError("a step with tokens in flight runs on one rank only (async scheduling)")
        return replace(self, spans=[], pool_spans=[], last_idx=[])


def build(scheduled: list[ScheduledRequest], block_size: int, decode_rows: int) -> StepInputs:
    """`decode_rows`: up to this many new tokens of a request with context run as decode rows, each over its own
    prefix (verifying k proposals), not as a prefill chunk."""
    bs = block_size
    si = StepInputs()
    sample_rows: list[int] = []
    t = 0
    for s in scheduled:
        req, n, table = s.request, s.num_new_tokens, s.block_table
        start = req.num_computed_tokens
        ctx = start + n
        known = req.all_token_ids
        si.ids.extend(known[start:ctx])
        if ctx > len(known) and s.spec_token_ids:  # the proposals after the known tokens
            si.ids.extend(s.spec_token_ids[max(start - len(known), 0) : ctx - len(known)])
        elif ctx > len(known):  # async scheduling: tokens the step in flight samples, read on the device
            for p in range(max(start, len(known)), ctx):
                si.placeholders.append((t + p - start, req.request_id))
                si.ids.append(0)
        pos = range(start, ctx)
        si.positions.extend(pos)
        mm = getattr(req, "mm", None)  # a draft's stand-in for a request has none
        if mm is not None:
            offsets, embeds = mm.rows_in(start, ctx)
            if offsets:
                si.image_rows.extend(t + o for o in offsets)
                si.image_embeds.append(embeds)
            if mm.mrope_positions is not None:
                if si.mrope_positions is None:  # the rows before this request's: text, their streams equal
                    si.mrope_positions = [list(si.positions[:t]) for _ in range(3)]
                for stream, rows in zip(si.mrope_positions, mm.positions(start, ctx)):
                    stream.extend(rows)
        elif si.mrope_positions is not None:
            for stream in si.mrope_positions:
                stream.extend(pos)
        si.slots.extend(table[p // bs] * bs + p % bs for p in pos)
        si.query_lens.append(n)
        if n == 1 or (start > 0 and n <= decode_rows):
            si.decode_idx.extend(range(t, t + n))
            si.decode_tables.extend([table] * n)
            si.decode_ctx.extend(range(start + 1, ctx + 1))
        else:
            si.prefills.append(PrefillSeq(t, n, ctx, len(si.prefill_tables)))
            si.prefill_tables.append(table)
        if getattr(req, "wants_prompt_logprobs", False):  # a draft's stand-in for a request has none
            # position p predicts token p + 1; the scored prompt tokens so far are 1 .. len(prompt_logprobs)
            lo = max(start, len(req.prompt_logprobs))
            hi = min(ctx, req.num_prompt_tokens - 1)
            if lo < hi:
                si.spans.append(PromptLogprobSpan(req.request_id, len(si.logits_rows), lo, hi))
                si.logits_rows.extend(range(t + lo - start, t + hi - start))
        if getattr(req, "pools", False):
            kind = req.sampling_params.pooling.pooling_type
            si.pool_spans.append(PoolSpan(req.request_id, t, n, start, ctx == req.num_tokens, kind))
        t += n
        si.last_idx.append(t - 1)
        if s.samples_next_token:
            sample_rows.extend(range(t - 1 - len(s.spec_token_ids), t))
    si.num_prompt_rows = len(si.logits_rows)
    si.logits_rows.extend(sample_rows)
    return si


def split(scheduled: list[ScheduledRequest], parts: int) -> list[list[ScheduledRequest]]:
    """Contiguous groups of about equal token counts (a pipeline's micro-batches), as many as `parts` at most."""
    total = sum(s.num_new_tokens for s in scheduled)
    groups: list[list[ScheduledRequest]] = [[] for _ in range(max(1, parts))]
    start = 0
    for s in scheduled:  # each request to the group its first token falls in
        groups[min(len(groups) - 1, start * len(groups) // max(total, 1))].append(s)
        start += s.num_new_tokens
    return [g for g in groups if g]


def to_tensors(
    si: StepInputs, device: torch.device, varlen: bool = False
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's tensors on `device`. Every integer field travels in one host-to-device copy (from pinned memory on
    CUDA, without waiting for it): a copy per field costs a launch and a sync each, which a GPU step cannot spare.
    `varlen`: a step with prefills also gets its sequences as one varlen batch (prefill chunks and decode rows
    alike), for the attention kernels that take a mixed step in one call."""
    host = _Packed()
    ids, positions, slots = host.add(si.ids), host.add(si.positions), host.add(si.slots)
    prefill_tables = host.add_table(si.prefill_tables) if si.prefill_tables else None
    decode = None
    if si.decode_idx:
        decode = host.add(si.decode_idx), host.add_table(si.decode_tables), host.add(si.decode_ctx)
    seq_fields = None
    if varlen and si.prefills:
        seqs = [(start, n, ctx, si.prefill_tables[row]) for start, n, ctx, row in si.prefills]
        seqs += [(t, 1, c, tb) for t, c, tb in zip(si.decode_idx, si.decode_ctx, si.decode_tables)]
        starts, lens, ctxs, tables = (list(x) for x in zip(*seqs))
        seq_fields = host.add(starts), host.add(lens), host.add(ctxs), host.add_table(tables), max(lens)
    dev = host.to(device)
    meta = AttentionMetadata(
        query_lens=si.query_lens,
        slot_mapping=dev(slots),
        prefills=si.prefills,
        block_tables=dev(prefill_tables) if prefill_tables else None,
    )
    if decode is not None:
        meta.decode_token_idx, meta.decode_block_tables, meta.decode_context_lens = (dev(x) for x in decode)
        meta.decode_max_context = max(si.decode_ctx)
    if seq_fields is not None:
        meta.seq_query_start, meta.seq_query_lens, meta.seq_context_lens, meta.seq_block_tables = (
            dev(x) for x in seq_fields[:4]
        )
        meta.max_query_len = seq_fields[4]
    return dev(ids), dev(positions), meta


class _Packed:
    """Integer fields laid end to end in one int64 buffer; `add` returns where a field lies, `to(device)` a function
    that gives each field's view of the one copy."""

    def __init__(self):
        self.values: list[int] = []

    def add(self, values: list[int]) -> tuple[int, tuple[int, ...]]:
        start = len(self.values)
        self.values.extend(values)
        return start, (len(values),)

    def add_table(self, rows: list[list[int]]) -> tuple[int, tuple[int, ...]]:
        """Rows padded with block 0 to the longest (entries past a row's context are never read)."""
        width = max(len(r) for r in rows)
        start = len(self.values)
        for r in rows:
            self.values.extend(r)
            self.values.extend([0] * (width - len(r)))
        return start, (len(rows), width)

    def to(self, device: torch.device):
        flat = to_device(self.values, device, torch.long)

        def view(field: tuple[int, tuple[int, ...]]) -> torch.Tensor:
            start, shape = field
            return flat[start : start + math.prod(shape)].view(shape)

        return view
