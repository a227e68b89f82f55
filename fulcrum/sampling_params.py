"""SamplingParams: how one request is decoded. Field names and meanings follow vLLM and OpenAI.

Every field is checked here, for the server, `LLM(...)` and `fulcrum generate` alike, with its real range (`_validate`);
what depends on the model (token ids below the vocabulary, lengths against the context) is checked by the engine at
admission."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import numpy as np

from fulcrum.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature is greedy (vLLM's choice too): dividing logits by it overflows float32.
MIN_TEMPERATURE = 1e-5
LOGIT_BIAS_LIMIT = 100.0
DEFAULT_MAX_TOKENS = (
    128  # `fulcrum generate` and `LLM.chat` without sampling params  # OpenAI's range for logit_bias values
)


def is_int(x) -> bool:
    """An integer that is not a bool (JSON `true` must never pass as 1)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def is_int64(x) -> bool:
    return is_int(x) and INT64_MIN <= x <= INT64_MAX


def is_real(x) -> bool:
    return isinstance(x, int | float | np.floating) and not isinstance(x, bool) and math.isfinite(x)


def as_float32(x: float) -> float:
    return float(np.float32(x))


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, vLLM's `structured_outputs` (its `guided_*` fields and OpenAI's `response_format`
    map onto it): exactly one of the constraints below. The grammar engine (engine/structured) checks that it
    compiles; here only the shapes are checked."""

    json: str | None = None  # a JSON schema, as JSON text (a dict is serialized)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF, as xgrammar and llama.cpp write it)
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    # JSON's whitespace between tokens: True none; False (vLLM's "any whitespace") free, up to indentation several
    # levels deep; None (not given) a little, MAX_WHITESPACE in a row (engine/structured/grammar.py)
    disable_any_whitespace: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        for name in ("json", "structural_tag"):
            v = getattr(self, name)
            if isinstance(v, dict):
                try:
                    setattr(self, name, json.dumps(v, ensure_ascii=False))
                except RecursionError:
                    raise InvalidRequestError(f"structured_outputs.{name} is nested too deeply", name) from None
            elif v is not None and not isinstance(v, str):
                raise InvalidRequestError(f"structured_outputs.{name} must be a JSON object or its text", name)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of non-empty strings", "choice"
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string", name)
        for name in ("json_object", "disable_any_whitespace"):
            v = getattr(self, name)
            if not isinstance(v, bool) and not (v is None and name == "disable_any_whitespace"):
                raise InvalidRequestError(f"structured_outputs.{name} must be true or false", name)
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output takes exactly one of json, regex, choice, grammar, json_object or structural_tag"
                + (f", got {', '.join(given)}" if given else ", got none"),
                param="structured_outputs",
            )

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the compile cache's key)."""
        return tuple(getattr(self, f.name) if f.name != "choice" else tuple(self.choice or ()) for f in fields(self))


@dataclass
class PoolingParams:
    """An embedding request: the prompt's final hidden states pooled into one vector instead of generating.
    `pooling_type` last, mean or cls; `normalize` L2-normalises it; `dimensions` keeps the leading ones (a
    matryoshka model), normalised after the cut. The frontend resolves every field against the model's pooler
    (model_folder/pooling.py) before the core sees it."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in ("last", "mean", "cls"):
            raise InvalidRequestError(
                f"pooling_type must be last, mean or cls, got {_short(self.pooling_type)}", param="pooling_type"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize must be true or false", param="normalize")
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise InvalidRequestError(
                f"dimensions must be a positive integer, got {_short(self.dimensions)}", param="dimensions"
            )


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off; above the vocabulary it keeps the whole vocabulary, as in vLLM
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled token is always included)
    # top-k logprobs at every prompt position (the prompt's own token always included; the first has none)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a grammar every output token must follow
    pooling: PoolingParams | None = None  # an embedding: the prompt pooled into one vector, nothing generated

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            self.logit_bias = self.logit_bias or None
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Integers must fit the int64 the engine-core messages and torch generators carry, floats must stay
        meaningful once rounded to the float32 the sampler computes in."""

        def bad(name: str, why: str):
            raise InvalidRequestError(f"{name} {why}, got {_short(getattr(self, name))}", param=name)

        def check_real(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            ok = is_real(v) and (lo < v if lo_open else lo <= v) and v <= hi
            if not ok:
                bad(name, f"must be a number in {'(' if lo_open else '['}{lo}, {hi}]")

        # integers: bounded to int64, which the engine-core messages and torch generators carry
        if not is_int(self.n) or not 1 <= self.n <= 1024:
            bad("n", "must be an integer in [1, 1024]")
        if not is_int64(self.top_k) or self.top_k < 0:
            bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if self.max_tokens is not None and (not is_int64(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not is_int64(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        # sample i of n draws with seed + i: every one must fit
        if self.seed is not None and (not is_int64(self.seed) or self.seed + self.n - 1 > INT64_MAX):
            bad("seed", f"must be an integer in [{INT64_MIN}, {INT64_MAX} - (n - 1)]")
        # floats: finite, and still in range after rounding to float32
        check_real("temperature", 0, 1e6)
        check_real("top_p", 0, 1, lo_open=True)
        if as_float32(self.top_p) <= 0:
            bad("top_p", "rounds to 0 in float32 (it must be at least about 1e-45)")
        check_real("min_p", 0, 1)
        check_real("presence_penalty", -2, 2)
        check_real("frequency_penalty", -2, 2)
        check_real("repetition_penalty", 0, 1e6, lo_open=True)
        if as_float32(self.repetition_penalty) < 1e-6:
            bad("repetition_penalty", "must be at least 1e-6 (dividing a logit by less overflows float32)")
        # token ids: integers >= 0 here; the engine checks them against the vocabulary
        if not isinstance(self.stop_token_ids, list) or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integer token ids")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must map token ids to numbers")
            for tok, v in self.logit_bias.items():
                if not is_int(tok) or tok < 0:
                    bad("logit_bias", "keys must be non-negative integer token ids")
                if not is_real(v) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                    bad("logit_bias", f"values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            # a finished grammar allows only the end of sequence: forbidding it leaves no token to sample
            if self.ignore_eos:
                bad("ignore_eos", "cannot be combined with structured output (the grammar ends the output with EOS)")
            if self.min_tokens:
                bad("min_tokens", "cannot be combined with structured output (the grammar decides the length)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the output so far (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """The token ids this request names, by field, for the engine to check against its vocabulary."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or {})}


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
