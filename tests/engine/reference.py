"""A reference generator: recomputes the whole sequence every step (no KV cache).

Slow by design and obviously correct: an oracle for the paged engine that needs neither the
scheduler nor the KV cache, only the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fulcrum.layers.attention import AttentionMetadata


@torch.no_grad()
def next_token_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    x = torch.tensor(ids, device=device)
    pos = torch.arange(len(ids), device=device)
    hidden = model(x, pos, AttentionMetadata.for_prompts([len(ids)]))
    return model.compute_logits(hidden[-1:])[0].float()


def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    max_tokens: int,
    eos_token_ids: list[int] = (),
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield new token ids one by one: greedy at temperature 0, else sampled (optionally top-k)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = next_token_logits(model, ids)
        if temperature == 0:
            tok = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            tok = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=gen))
        yield tok
        if tok in eos_token_ids:
            return
        ids.append(tok)
