"""A request's prompt as token ids, as the replica will see them (the model's tokenizer and chat template),
and their chained block hashes at any block size. Approximate by design: the router guesses the replica's cache."""

from __future__ import annotations

import functools
import logging

from fulcrum.utils.hashing import hash_prefix_blocks

log = logging.getLogger("fulcrum.router")


class PromptTokenizer:
    def __init__(self, model: str | None):
        self.tokenizer = None
        if model:
            from transformers import AutoTokenizer  # the router needs the tokenizer, never the model or torch

            self.tokenizer = AutoTokenizer.from_pretrained(model)

    def token_ids(self, endpoint: str, body: dict) -> list[int]:
        if endpoint == "chat":
            messages = body.get("messages") or []
            if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
                try:
                    ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                    # transformers 5 answers a BatchEncoding (a mapping, not a dict): its keys are no token ids
                    return list(ids if isinstance(ids, list) else ids["input_ids"])
                except Exception as e:  # a template that refuses these messages: route on the text instead
                    log.debug("chat template failed (%s); hashing the raw text", e)
            text = "".join(f"{m.get('role')}\n{_content(m.get('content'))}\n" for m in messages)
            return self._encode(text)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, list):  # a batch: route on its first prompt
            prompt = prompt[0] if prompt else ""
            if isinstance(prompt, list):
                return list(prompt)
        return self._encode(str(prompt))

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:  # no --model: bytes stand in for tokens (prefixes still match, blocks are shorter)
            return list(text.encode())
        return self.tokenizer.encode(text)


def _content(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def hasher(token_ids: list[int]):
    """block size -> chained hashes of the full blocks, computed once per size."""
    return functools.lru_cache(maxsize=None)(lambda block_size: hash_prefix_blocks(token_ids, block_size))
