"""Prompts in every shape users give them, to the server and to `LLM.generate` alike: a text, token ids,
a dict with `prompt` or `prompt_token_ids` (vLLM's), or a list of those; each as (text or None, token ids)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import is_int

PromptIds = tuple[str | None, list[int]]


def _is_ids(p) -> bool:
    return isinstance(p, Sequence) and not isinstance(p, str) and bool(p) and all(is_int(t) for t in p)


def tokenize_prompts(prompts, tokenizer: PreTrainedTokenizerBase) -> list[PromptIds]:
    if isinstance(prompts, str | dict) or _is_ids(prompts):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, tokenizer(p)["input_ids"]))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            out.append((p.get("prompt"), list(p["prompt_token_ids"])))
        elif isinstance(p, dict) and "prompt" in p:
            out.append((p["prompt"], tokenizer(p["prompt"])["input_ids"]))
        elif _is_ids(p):
            out.append((None, list(p)))
        else:
            raise InvalidRequestError(
                "a prompt must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'",
                param="prompt",
            )
    return out
