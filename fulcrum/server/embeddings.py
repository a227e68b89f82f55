"""POST /v1/embeddings (OpenAI's): one vector per input from an embedding model (fulcrum serve --task embed, or a
sentence-transformers folder). Every input of a request goes to the engine core in one message, so a batch is
scheduled together; vectors come back as floats or as base64 of little-endian float32 (`encoding_format`), cut to
`dimensions` on a matryoshka model. vLLM's extras: `normalize`, `priority`."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from fulcrum.engine.prompts import tokenize_prompts
from fulcrum.engine.request import resolve_pooling
from fulcrum.errors import InvalidRequestError
from fulcrum.http_errors import validation_message
from fulcrum.sampling_params import SamplingParams
from fulcrum.server.limits import json_body, off_loop
from fulcrum.server.stages import arrival_of
from fulcrum.server.streaming import until_done

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    """Unknown fields are a 400 naming them (vLLM's truncate_prompt_tokens, add_special_tokens, messages, ... are
    not implemented)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id: recorded nowhere, as in vLLM
    # vLLM's
    normalize: bool | None = None
    priority: int = 0


def parse(data) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate(data)
    except ValidationError as e:
        raise InvalidRequestError(*validation_message(e)) from None


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(state, request: Request):
    data = await json_body(request)
    req = parse(data)
    if state.check_model(req.model) is not None:
        raise InvalidRequestError("embeddings with a LoRA adapter are not supported", param="model")
    if isinstance(req.input, list) and not req.input:
        raise InvalidRequestError("input is empty: give a string, a list of strings or token ids", param="input")
    engine = state.engine
    prompts = await off_loop(tokenize_prompts, req.input, engine.tokenizer)
    if len(prompts) > MAX_INPUTS:
        raise InvalidRequestError(f"input has {len(prompts)} items; at most {MAX_INPUTS} per request", param="input")
    for i, (_, ids) in enumerate(prompts):
        if not ids:
            raise InvalidRequestError(f"input {i} is empty", param="input")
    ready = engine.ready
    if ready.task != "embed":
        raise InvalidRequestError(
            "this model generates text: start the server with --task embed (or on a sentence-transformers model "
            "folder) to serve embeddings",
            param="model",
        )
    pooling = resolve_pooling(ready.pooler, ready.hidden_size, None, req.normalize, req.dimensions)
    params = SamplingParams(max_tokens=1, pooling=pooling)
    try:
        outputs = await until_done(engine.encode(prompts, params, req.priority, arrival_of(request)), request)
    except InvalidRequestError as e:  # the engine's checks name a prompt; here it is an input
        if e.param == "prompt":
            e.param = "input"
        raise
    if isinstance(outputs, Response):
        return outputs
    tokens = sum(len(ro.prompt_token_ids) for ro in outputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(ro.embedding, req.encoding_format)}
            for i, ro in enumerate(outputs)
        ],
        "model": state.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
