"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) guess the next k tokens of each request,
the target verifies them all in one forward (engine/model_runner.py), and rejection sampling (rejection.py) keeps
the output distributed exactly as the target's."""

from __future__ import annotations

from fulcrum.engine.spec.config import SpeculativeConfig
from fulcrum.engine.spec.stats import SpecDecodeStats

__all__ = ["SpeculativeConfig", "SpecDecodeStats", "make_proposer"]


def make_proposer(spec: SpeculativeConfig, config, model_config):
    """The proposer `spec` names. A draft model is loaded here, before the target sizes the KV cache they share."""
    if spec.method == "ngram":
        from fulcrum.engine.spec.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from fulcrum.engine.spec.draft import DraftModelProposer

    return DraftModelProposer(spec, config, model_config)
