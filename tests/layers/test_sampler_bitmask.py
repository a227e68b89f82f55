"""The sampler's grammar bitmask: forbidden tokens are never drawn, only the grammar rows are touched, and the
tokens past the last full 32-bit word of the vocabulary are handled."""

import torch

from fulcrum.layers.sampler import Sampler, SamplingMetadata, apply_token_bitmask


def bitmask_allowing(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for row, toks in enumerate(allowed):
        for t in toks:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits as int32 words


def test_only_allowed_tokens_are_drawn_and_free_rows_untouched():
    vocab = 1000  # not a multiple of 32
    allowed = [[3, 999], [0], list(range(vocab))]
    bitmask = bitmask_allowing(allowed, vocab)
    for seed in range(20):
        torch.manual_seed(seed)
        logits = torch.randn(3, vocab) * 5
        free = logits[2].clone()
        meta = SamplingMetadata(temperature=torch.ones(3), all_greedy=False, token_bitmask=bitmask, bitmask_rows=[0, 1])
        out = Sampler()(logits.clone(), meta)
        assert out.token_ids[0].item() in (3, 999) and out.token_ids[1].item() == 0
        masked = apply_token_bitmask(logits.clone(), bitmask, [0, 1])
        assert torch.equal(masked[2], free)
        assert torch.isinf(masked[0]).sum() == vocab - 2 and masked[0, 999] == logits[0, 999]


def test_greedy_takes_the_best_allowed_token():
    logits = torch.tensor([[5.0, 1.0, 3.0, 0.0]])
    meta = SamplingMetadata(temperature=torch.zeros(1), all_greedy=True, token_bitmask=bitmask_allowing([[1, 2]], 4))
    assert Sampler()(logits, meta).token_ids.tolist() == [2]
