"""Our model code gives the same logits as transformers on the same weights."""

import pytest
import torch

from fulcrum.config import DEFAULT_MODEL, ModelConfig
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.models.loader import load_model
from tests.tiny_models import FAMILIES, hf_model, save_tiny_model

PROMPT_LENS = [1, 5, 17, 40]


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def our_logits(model, batch: list[list[int]]) -> list[torch.Tensor]:
    """One flattened forward over all prompts; logits for every position of each."""
    ids = torch.tensor([t for p in batch for t in p])
    pos = torch.tensor([i for p in batch for i in range(len(p))])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, AttentionMetadata.for_prompts([len(p) for p in batch])))
    return list(logits.float().split([len(p) for p in batch]))


def hf_logits(model, batch: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in batch]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    theirs = hf_model(folder)
    batch = prompts(ours.config.vocab_size)
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


# bf16 rounds every activation to 8 bits of mantissa; the two implementations order some
# operations differently; measured differences are 1-3 bf16 ulps (about 1.5% of the largest logit).
BF16_TOL = 0.03


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_logits_close_to_transformers(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    ours = load_model(ModelConfig.from_path(folder, dtype="bfloat16"))
    theirs = hf_model(folder, dtype=torch.bfloat16)
    batch = prompts(ours.config.vocab_size)
    ref32 = hf_logits(hf_model(folder), batch)
    diff = max_diff(our_logits(ours, batch), hf_logits(theirs, batch))
    scale = max(x.abs().max().item() for x in ref32)
    assert diff <= BF16_TOL * max(scale, 1.0)


def test_bundled_model_matches_transformers():
    ours = load_model(ModelConfig.from_path(DEFAULT_MODEL))
    theirs = hf_model(DEFAULT_MODEL)
    batch = prompts(ours.config.vocab_size, seed=7)
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4
