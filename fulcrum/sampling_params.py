"""SamplingParams: how one request is decoded. Field names and meanings follow vLLM and OpenAI."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.errors import InvalidRequestError


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str):
            raise InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 or -1 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
