"""What the engine hands back: per-step core outputs and the user-facing RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineCoreOutput:
    """One request's progress in one engine step (token ids only; text is the frontend's job)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    # once, with the first output: per prompt token after the first, {token_id: (logprob, rank)}
    prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None
    finish_reason: str | None = None  # stop, length, abort
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None  # with finish_reason "error": why the request failed
    error_status: int = 500  # 400 when the request itself was at fault (a grammar that cannot be compiled)
    kv_transfer_params: dict | None = None  # a KV producer's finished prefill: where its blocks can be pulled
    embedding: list[float] | None = None  # an embedding request's vector, once its prompt is pooled


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": why this sample failed
    error_status: int = 500  # 400 when the request itself was at fault (a grammar that cannot be compiled)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: (logprob, rank)}
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = None  # from a KV producer, once finished (engine/kv_transfer)
    embedding: list[float] | None = None  # an embedding request's vector (SamplingParams.pooling), once finished


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed()`'s result per prompt, as vLLM's: `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
