"""vLLM's routes for LoRA adapters at run time: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, served only
when runtime updating is allowed (`fulcrum serve --allow-runtime-lora-updating`, or vLLM's environment variable
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), as vLLM serves them. A loaded adapter's name is a model name in /v1/models
(its `parent` the base model) and in any request's `model` field."""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from fulcrum.errors import InvalidRequestError, ModelNotFoundError
from fulcrum.http_errors import ERROR_RESPONSES

RUNTIME_ENV = ("FULCRUM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in RUNTIME_ENV)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name; refused (400) when true


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, unused: adapters are named


def add(app: FastAPI, state) -> None:
    if not runtime_updating():
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        """Load a PEFT adapter folder under a name every request's `model` may then give."""
        if req.load_inplace:
            raise InvalidRequestError("load_inplace is not supported: unload the adapter, then load it", "load_inplace")
        if not req.lora_name or req.lora_name in state.loras or req.lora_name == state.model_name:
            raise InvalidRequestError(f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
        await state.engine.lora("load", req.lora_name, req.lora_path)
        state.loras[req.lora_name] = req.lora_path
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        """Unload an adapter; refused (400) while requests that name it are queued or running."""
        if req.lora_name not in state.loras:
            raise ModelNotFoundError(f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name")
        await state.engine.lora("unload", req.lora_name)
        del state.loras[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
