"""Speculative decoding's part of an engine step: after the target samples, proposals for the requests that may take
them (checked by their grammar), the draft state of requests no longer running released, acceptance counted."""

from __future__ import annotations

import logging

from fulcrum.engine.request import Request, RequestStatus
from fulcrum.engine.spec.config import SpeculativeConfig
from fulcrum.engine.spec.stats import SpecDecodeStats
from fulcrum.engine.structured.grammar import MAX_ROLLBACK_TOKENS
from fulcrum.errors import is_fatal

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer, max_model_len: int):
        self.spec = spec
        self.proposer = proposer  # engine/spec/ngram.py or draft.py
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def observe(self, sched, result) -> None:
        """Count what the step's verification kept of each request's proposals."""
        for s in sched.scheduled:
            if s.spec_token_ids and s.request.request_id in result.sampled:
                self.stats.observe(len(s.spec_token_ids), len(result.sampled[s.request.request_id]) - 1)

    def propose(self, sched, result, requests: dict[str, Request], num_running: int) -> None:
        """Proposals for the requests that just sampled a token, for the next step to verify. A step that runs more
        requests than the policy allows proposes none (spec/config.py: disable_by_batch_size)."""
        self.release(requests)
        if not self.spec.proposes_for(num_running):
            return
        reqs, ks = [], []
        for s in sched.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING or req.request_id not in result.sampled:
                continue
            k = self._room(req)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return
        try:
            drafts, probs = self.proposer.propose(reqs, ks)
        except Exception as e:  # proposals are optional: a failing draft leaves the step without them
            if is_fatal(e):
                raise
            log.warning("the proposer failed (%s); this step goes on without speculation", e)
            return
        for i, req in enumerate(reqs):
            d, q = drafts[i], probs[i] if probs is not None else None
            if req.grammar is not None:
                d, q = grammar_checked(req, d, q)
            req.spec_token_ids, req.spec_token_probs = d, q

    def _room(self, req: Request) -> int:
        """Proposals worth making: no more than k, than max_tokens leaves after the token the target draws anyway,
        than the context holds, or than a grammar can roll back."""
        left = req.sampling_params.max_tokens - req.num_output_tokens - 1
        k = min(self.spec.num_speculative_tokens, left, self.max_model_len - req.num_tokens)
        return min(k, MAX_ROLLBACK_TOKENS) if req.grammar is not None else k

    def release(self, requests: dict[str, Request]) -> None:
        """Free the draft state of every request no longer running (finished, aborted, failed or preempted)."""
        gone = [
            rid
            for rid in self.proposer.tracked()
            if rid not in requests or requests[rid].status != RequestStatus.RUNNING
        ]
        self.proposer.release(gone)


def grammar_checked(req: Request, drafts: list[int], q):
    """The grammar checks proposals: those after the first it refuses are dropped. The refused one itself stays
    when drawn from a draft distribution: its row masks it, so it is rejected there and the target draws from
    the residual, which is what keeps the output exact (dropping it would draw from p instead)."""
    ok = 0
    for tok in drafts:
        if not req.grammar.accept(tok):
            break
        ok += 1
    if ok:
        req.grammar.rollback(ok)
    if ok == len(drafts):
        return drafts, q
    if q is None:
        return drafts[:ok], None
    return drafts[: ok + 1], q[: ok + 1]
