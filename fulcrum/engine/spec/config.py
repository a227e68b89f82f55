"""`speculative_config` as vLLM spells it (`--speculative-config '{"method": "ngram", ...}'`), checked once.

Only the keys fulcrum acts on are accepted: a key it would silently ignore (eagle's, a draft's tensor-parallel size)
is refused with the list of those it takes, so a config copied from a vLLM command line never half-applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fulcrum.errors import InvalidRequestError

METHODS = ("ngram", "draft_model")
# Past this many running requests a step stops proposing (vLLM's disable_by_batch_size; null: never). Left out, it is
# the device's measured crossover: on a CPU every verified token costs real FLOPs, so speculation pays only at
# batch 1-2 (benchmarks/results/cpu-spec-decode.log); on CUDA, not measured yet, it stays on.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 2, "cuda": None}
_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
}


MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # k: tokens proposed per request per step
    model: str | None = None  # the draft model's folder (draft_model)
    prompt_lookup_min: int = 5  # n-gram: the shortest suffix matched
    prompt_lookup_max: int = 5  # n-gram: the longest suffix tried first
    # no proposals in a step that runs more requests than this (None: always propose)
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: dict | str | SpeculativeConfig | None, device: str = "cpu") -> SpeculativeConfig | None:
        """A dict, its JSON text, or None (no speculation), for an engine on `device` (the policy's default).
        Raises InvalidRequestError naming the key at fault."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _bad(f"is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise _bad(f"must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise _bad(f"has keys fulcrum does not use: {', '.join(unknown)} (it takes {', '.join(sorted(_KEYS))})")
        method, model = value.get("method"), value.get("model")
        if method is None:  # vLLM infers the method from the model: "[ngram]" or a draft's folder
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
        if method == "draft" or method == "draft_model":
            method = "draft_model"
        if method not in METHODS:
            raise _bad(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not _is_count(k, 1):
            raise _bad(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if k > MAX_SPECULATIVE_TOKENS:
            raise _bad(
                f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got {k} (each step verifies k + 1 "
                "tokens of every request, and acceptance falls with each position)"
            )
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method == "ngram":
            # vLLM's defaults: both 5, or the one given for both
            lo, hi = (
                (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            )
            if not _is_count(lo, 1) or not _is_count(hi, lo):
                raise _bad(f"needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
            model = None
        else:
            if not isinstance(model, str | Path) or not str(model):
                raise _bad("method draft_model needs 'model': the draft model's folder")
            lo = hi = 5
        limit = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE.get(str(device).split(":")[0]))
        if limit is not None and not _is_count(limit, 1):
            raise _bad(f"disable_by_batch_size must be an integer >= 1 or null, got {limit!r}")
        return cls(method, k, str(model) if model else None, lo, hi, limit)

    def proposes_for(self, num_running: int) -> bool:
        """Whether a step with this many running requests speculates (the large-batch policy)."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


def _is_count(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _bad(what: str) -> InvalidRequestError:
    return InvalidRequestError(f"speculative_config {what}", param="speculative_config")
