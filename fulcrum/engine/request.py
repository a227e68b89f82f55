"""A request as the engine core sees it: token ids, progress, blocks, and its own sampling state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

import torch

from fulcrum.engine.multimodal import MultiModalInput
from fulcrum.engine.structured import GrammarState, validate
from fulcrum.errors import InvalidRequestError
from fulcrum.model_folder.pooling import PoolerConfig
from fulcrum.sampling_params import PoolingParams, SamplingParams, is_int, is_int64


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside a step; the engine and the other requests go on

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens resolved by check_request (None: up to the context limit)
    eos_token_ids: list[int] = field(default_factory=list)
    priority: int = 0  # lower runs first, as in vLLM
    arrival_time: float = field(default_factory=time.time)

    output_token_ids: list[int] = field(default_factory=list)
    # per generated token: {token_id: logprob} of the sampled token plus the top-k
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # per prompt token after the first: {token_id: (logprob, rank)} of that token plus the top-k
    prompt_logprobs: list[dict[int, tuple[float, int]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # async scheduling: tokens sampled by a step still in flight, counted as known for scheduling (the next step
    # computes them from the device) until the step's results come back
    num_placeholders: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None  # why it failed, with FINISHED_ERROR
    error_status: int = 500  # 400 when the request itself was at fault (its grammar cannot be compiled)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    grammar: GrammarState | None = None  # with structured output: the tokens its grammar allows next
    # speculative decoding: tokens proposed after the known ones, for the next step to verify, and the draft
    # distribution each was drawn from ([len, vocab]; None for deterministic proposals: n-gram, a greedy draft)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: torch.Tensor | None = None
    # P/D disaggregation (engine/kv_transfer): vLLM's kv_transfer_params as the request gave them; on a producer,
    # once finished, what a consumer needs to pull the prompt's blocks
    kv_transfer_params: dict | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (engine/lora.py); None: the base model
    # a vision-language prompt's images: their embedding rows and M-RoPE positions (engine/multimodal.py)
    mm: MultiModalInput | None = None

    # an embedding request (sampling_params.pooling): what its prompt's chunks pooled so far (the sum of their
    # hidden states for mean pooling, the first for CLS) on the device, then the finished vector
    pool_state: torch.Tensor | None = None
    embedding: list[float] | None = None

    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def pools(self) -> bool:
        """An embedding request: its prompt is pooled, nothing is sampled."""
        return self.sampling_params.pooling is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


def check_request(
    prompt_ids: list[int], params: SamplingParams, priority: int, max_model_len: int, vocab_size: int
) -> SamplingParams:
    """Everything a request must pass before it is queued, checked once, in the frontend (a pure function of
    the request and the model's limits). Returns the params with max_tokens resolved against the context."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if not is_int64(priority):
        raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority!r}", param="priority")
    check_token_ids("prompt", prompt_ids, vocab_size)
    for name, ids in params.token_ids_to_check().items():
        check_token_ids(name, ids, vocab_size)
    if params.structured_outputs is not None:
        validate(params.structured_outputs)
    if params.pooling is not None:  # an embedding: the prompt alone, nothing generated after it
        if n > max_model_len:
            raise InvalidRequestError(
                f"the input has {n} tokens, but this model's maximum context length is {max_model_len} tokens",
                param="input",
            )
        return replace(params, max_tokens=1)
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, but this model's maximum context length is {max_model_len} tokens "
            "(the prompt plus at least one generated token must fit)",
            param="prompt",
        )
    mt = params.max_tokens
    if mt is not None and n + mt > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {n + mt} were requested "
            f"({n} in the prompt, {mt} for the completion); lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
    return params if mt is not None else replace(params, max_tokens=max_model_len - n)


def check_token_ids(param: str, ids: list[int], vocab_size: int) -> None:
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"{param}: token id {t!r} is not an integer in [0, {vocab_size}) (this model's vocabulary)", param
            )


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The n samples of one prompt as n engine requests `{request_id}-{i}`, sample i seeded seed + i.
    With prefix caching they share the prompt's blocks."""
    return [
        (f"{request_id}-{i}", replace(params, n=1, seed=None if params.seed is None else params.seed + i))
        for i in range(params.n)
    ]


def check_task(params: SamplingParams, task: str) -> None:
    """An embedding model pools and generates nothing; a generative one embeds nothing (as in vLLM: start the server
    with --task embed for embeddings)."""
    if task == "embed" and params.pooling is None:
        raise InvalidRequestError(
            "this model serves embeddings (--task embed): use /v1/embeddings (LLM.embed), not text generation",
            param="model",
        )
    if task != "embed" and params.pooling is not None:
        raise InvalidRequestError(
            "this model generates text: start it with --task embed (or give a sentence-transformers folder) "
            "to serve embeddings",
            param="model",
        )


def resolve_pooling(
    pooler: PoolerConfig,
    hidden_size: int,
    pooling_type: str | None = None,
    normalize: bool | None = None,
    dimensions: int | None = None,
) -> PoolingParams:
    """An embedding request's pooling: the model's (its pooler), with what the request overrides; `dimensions` only
    for a matryoshka model, up to its hidden size (or among the sizes it names)."""
    if dimensions is not None:
        if not pooler.matryoshka:
            raise InvalidRequestError(
                "this model does not support dimensions (it is not a matryoshka model: its config.json sets neither "
                "is_matryoshka nor matryoshka_dimensions)",
                param="dimensions",
            )
        if not is_int(dimensions) or not 1 <= dimensions <= hidden_size:
            raise InvalidRequestError(
                f"dimensions must be an integer in [1, {hidden_size}], got {dimensions!r}", param="dimensions"
            )
        if pooler.dimensions_allowed and dimensions not in pooler.dimensions_allowed:
            raise InvalidRequestError(
                f"dimensions must be one of {list(pooler.dimensions_allowed)} for this model, got {dimensions}",
                param="dimensions",
            )
        if dimensions == hidden_size:
            dimensions = None
    return PoolingParams(
        pooling_type or pooler.pooling_type, pooler.normalize if normalize is None else normalize, dimensions
    )
