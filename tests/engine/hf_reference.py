"""Reference outputs from Hugging Face transformers, the oracle of the engine tests."""

from __future__ import annotations

import torch

from tests.tiny_models import hf_model

_MODELS = {}


def _model(folder, device="cpu"):
    key = (str(folder), device)
    if key not in _MODELS:
        _MODELS[key] = hf_model(folder).to(device)
    return _MODELS[key]


@torch.no_grad()
def hf_greedy(folder, prompt: list[int], n: int, device="cpu") -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of `prompt` by n tokens (eos ignored), with each step's log-softmax."""
    model = _model(folder, device)
    ids = torch.tensor([prompt], device=device)
    out, logprobs = [], []
    past = None
    step_ids = ids
    for _ in range(n):
        res = model(step_ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].float()
        tok = int(logits.argmax())
        out.append(tok)
        logprobs.append(torch.log_softmax(logits, -1).cpu())
        step_ids = torch.tensor([[tok]], device=device)
    return out, logprobs


@torch.no_grad()
def hf_prompt_logprobs(folder, prompt: list[int], device="cpu") -> torch.Tensor:
    """The log-softmax at every prompt position but the last, [len(prompt) - 1, vocab]: row i scores token i + 1."""
    logits = _model(folder, device)(torch.tensor([prompt], device=device)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).cpu()
