"""One forward's inputs: a scheduler step flattened into token ids, positions, cache slots and the attention's
block tables, as plain lists (what rank 0 broadcasts to the other ranks of a parallel engine), then as tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from fulcrum.engine.scheduler import ScheduledRequest
from fulcrum.layers.attention import AttentionMetadata


@dataclass
class PromptLogprobSpan:
    """Rows [row, row + hi - lo) of a step's hidden states predict prompt tokens lo + 1 .. hi of `request_id`."""

    request_id: str
    row: int
    lo: int
    hi: int


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)  # (token start, query, context, row)
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
    last_idx: list[int] = field(default_factory=list)  # every request's last row

    def for_other_ranks(self) -> StepInputs:
        return replace(self, spans=[], last_idx=[])


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
        if ctx > len(known):  # the proposals after the known tokens
            si.ids.extend(s.spec_token_ids[max(start - len(known), 0) : ctx - len(known)])
        pos = range(start, ctx)
        si.positions.extend(pos)
        si.slots.extend(table[p // bs] * bs + p % bs for p in pos)
        si.query_lens.append(n)
        if n == 1 or (start > 0 and n <= decode_rows):
            si.decode_idx.extend(range(t, t + n))
            si.decode_tables.extend([table] * n)
            si.decode_ctx.extend(range(start + 1, ctx + 1))
        else:
            si.prefills.append((t, n, ctx, len(si.prefill_tables)))
            si.prefill_tables.append(table)
        if getattr(req, "wants_prompt_logprobs", False):  # a draft's stand-in for a request has none
            # position p predicts token p + 1; the scored prompt tokens so far are 1 .. len(prompt_logprobs)
            lo = max(start, len(req.prompt_logprobs))
            hi = min(ctx, req.num_prompt_tokens - 1)
            if lo < hi:
                si.spans.append(PromptLogprobSpan(req.request_id, len(si.logits_rows), lo, hi))
                si.logits_rows.extend(range(t + lo - start, t + hi - start))
        t += n
        si.last_idx.append(t - 1)
        if s.samples:
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


def to_tensors(si: StepInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    def table_tensor(tables):
        width = max(len(x) for x in tables)
        return torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.long, device=device)

    meta = AttentionMetadata(
        query_lens=si.query_lens,
        slot_mapping=torch.tensor(si.slots, dtype=torch.long, device=device),
        prefills=si.prefills,
        block_tables=table_tensor(si.prefill_tables) if si.prefill_tables else None,
    )
    if si.decode_idx:
        meta.decode_token_idx = torch.tensor(si.decode_idx, dtype=torch.long, device=device)
        meta.decode_block_tables = table_tensor(si.decode_tables)
        meta.decode_context_lens = torch.tensor(si.decode_ctx, dtype=torch.long, device=device)
        meta.decode_max_context = max(si.decode_ctx)
    input_ids = torch.tensor(si.ids, dtype=torch.long, device=device)
    positions = torch.tensor(si.positions, dtype=torch.long, device=device)
    return input_ids, positions, meta
