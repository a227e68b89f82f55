"""Speculative decoding's counters, as vLLM keeps them: drafts, proposed and accepted tokens, acceptance per
position. Cumulative; the server turns them into Prometheus counters, `LLM.stats()` reports them and their ratios."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # request-steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, kept
    # [k]: how often the proposal at each position (0 = the first) was kept
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos += [0] * (num_proposed - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float:
    """Kept proposals over proposals."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def mean_accepted_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """Tokens a speculating request gets per step: the accepted proposals plus the one the target draws (vLLM's
    mean acceptance length)."""
    return 1 + num_accepted_tokens / num_drafts if num_drafts else 0.0
