"""A batch's sampling parameters as the sampler's tensors (layers/sampler.py: SamplingMetadata): one row per request
that samples, or per verified row under speculative decoding, with only the columns some request needs."""

from __future__ import annotations

import torch

from fulcrum.engine.request import Request
from fulcrum.engine.structured import StructuredOutputs
from fulcrum.layers.sampler import SamplingMetadata
from fulcrum.utils.device import to_device


class SamplingInputs:
    def __init__(self, device: torch.device, vocab_size: int, structured: StructuredOutputs | None):
        self.device, self.vocab_size, self.structured = device, vocab_size, structured

    def build(self, reqs: list[Request], ahead: list[list[int]] | None = None) -> SamplingMetadata:
        """One row per entry of `reqs`. Verifying proposals, a request has several rows, and `ahead[i]` are the
        proposals before row i, counted as output already (penalties, min_tokens, the grammar's state)."""
        dev, V = self.device, self.vocab_size
        params = [r.sampling_params for r in reqs]
        ahead = ahead or [[] for _ in reqs]

        def col(values, dtype=torch.float32):
            return to_device(values, dev, dtype)

        temps = [0.0 if p.greedy else p.temperature for p in params]
        meta = SamplingMetadata(temperature=col(temps), all_greedy=all(p.greedy for p in params))
        if any(p.top_p < 1 for p in params):
            meta.top_p = col([p.top_p for p in params])
        if any(0 < p.top_k < V for p in params):
            # a top_k at or above the vocabulary keeps all of it (clamped, as vLLM does)
            meta.top_k = col([p.top_k if 0 < p.top_k < V else V for p in params], torch.long)
        if any(p.min_p > 0 for p in params):
            meta.min_p = col([p.min_p for p in params])
        if any(p.penalized for p in params):
            meta.output_counts = self._token_counts([r.output_token_ids + a for r, a in zip(reqs, ahead)])
            if any(p.presence_penalty for p in params):
                meta.presence_penalty = col([p.presence_penalty for p in params])
            if any(p.frequency_penalty for p in params):
                meta.frequency_penalty = col([p.frequency_penalty for p in params])
            if any(p.repetition_penalty != 1 for p in params):
                meta.repetition_penalty = col([p.repetition_penalty for p in params])
                meta.prompt_mask = self._token_counts([r.prompt_token_ids for r in reqs]) > 0
        under_min = [
            i
            for i, (r, a) in enumerate(zip(reqs, ahead))
            if r.num_output_tokens + r.num_placeholders + len(a) < r.sampling_params.min_tokens
        ]
        if under_min:
            banned = torch.zeros(len(reqs), V, dtype=torch.bool)  # built here, then one copy to the device
            for i in under_min:
                req = reqs[i]
                stop_ids = list(req.sampling_params.stop_token_ids)
                if not req.sampling_params.ignore_eos:
                    stop_ids += req.eos_token_ids
                banned[i, [t for t in stop_ids if 0 <= t < V]] = True
            meta.banned = to_device(banned, dev)
        if any(p.logit_bias for p in params):
            bias = torch.zeros(len(reqs), V)
            for i, p in enumerate(params):
                if p.logit_bias:
                    bias[i, list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()))
            meta.logit_bias = to_device(bias, dev)
        if not self.structured:
            masks = None
        elif any(ahead):
            masks = self._bitmask_ahead(reqs, ahead)
        else:
            masks = self.structured.fill_bitmask([r.grammar for r in reqs])
        if masks is not None:
            meta.token_bitmask, meta.bitmask_rows = masks
        if any(p.seed is not None for p in params):
            meta.generators = [r.generator for r in reqs]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else -1
        return meta

    def _bitmask_ahead(self, reqs: list[Request], ahead: list[list[int]]) -> tuple[torch.Tensor, list[int]] | None:
        """The grammar's bitmask at each verified row: a request's grammar advanced by each proposal in turn, then
        rolled back (the scheduler advances it by the tokens kept). A proposal the grammar refuses is masked at its
        own row, so it is rejected there; the rows after it are never used and allow everything."""
        if all(r.grammar is None for r in reqs):
            return None
        bitmask = torch.full((len(reqs), -(-self.vocab_size // 32)), -1, dtype=torch.int32)  # all allowed
        rows: list[int] = []
        i = 0
        while i < len(reqs):
            req, end = reqs[i], i + 1
            while end < len(reqs) and reqs[end] is req:
                end += 1
            if req.grammar is not None:
                advanced = 0
                for r in range(i, end):
                    if r > i:
                        if not req.grammar.accept(ahead[r][-1]):
                            break
                        advanced += 1
                    req.grammar.fill_bitmask(bitmask, r)
                    rows.append(r)
                if advanced:
                    req.grammar.rollback(advanced)
            i = end
        return bitmask, rows

    def _token_counts(self, lists: list[list[int]]) -> torch.Tensor:
        counts = torch.zeros(len(lists), self.vocab_size, device=self.device)
        width = max((len(x) for x in lists), default=0)
        if width:
            ids = torch.tensor([x + [0] * (width - len(x)) for x in lists], dtype=torch.long, device=self.device)
            ones = torch.tensor([[1.0] * len(x) + [0.0] * (width - len(x)) for x in lists], device=self.device)
            counts.scatter_add_(1, ids, ones)
        return counts
