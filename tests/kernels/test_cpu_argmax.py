"""Greedy decoding's argmax kernel picks torch's token on every row: the first of tied maxima, a NaN over any
number, the first of an all -inf row; and the sampler takes it only where nothing changes the logits first."""

import pytest
import torch

from fulcrum.kernels import cpu_argmax
from fulcrum.layers.sampler import Sampler, SamplingMetadata

pytestmark = pytest.mark.skipif(not cpu_argmax.available(), reason="needs an x86 CPU with AVX2 and a compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 63, 64, 65, 1000, 151936])
def test_every_row_gets_torchs_token(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).to(dtype)
    x[1] = float("-inf")  # nothing allowed: index 0, as torch
    x[2] = x[2].round()  # many ties: the first wins
    x[3, vocab // 2] = float("nan")  # a NaN beats every number
    x[4, -1] = float("inf")
    if vocab > 1:
        x[5, vocab // 3] = x[5, -1] = x[5].max() + 1  # a tie far apart
    got = cpu_argmax.argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(-1))
    assert torch.equal(got, x.float().argmax(-1))


def test_strided_rows_of_a_wider_tensor():
    wide = torch.randn(9, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = wide[:, :151]  # rows 300 apart
    assert cpu_argmax.usable(x)
    assert torch.equal(cpu_argmax.argmax(x), x.argmax(-1))


def test_not_taken_where_it_does_not_apply():
    assert not cpu_argmax.usable(torch.randn(4, 10).half())
    assert not cpu_argmax.usable(torch.randn(10))
    assert not cpu_argmax.usable(torch.randn(10, 4).t())  # vocabulary not unit-stride


def greedy(rows, **kw):
    return SamplingMetadata(temperature=torch.zeros(rows), all_greedy=True, max_num_logprobs=-1, **kw)


def test_the_sampler_draws_the_same_tokens_through_it(monkeypatch):
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(0)).bfloat16()
    calls = []
    real = cpu_argmax.argmax
    monkeypatch.setattr(cpu_argmax, "argmax", lambda x: calls.append(x.shape) or real(x))
    out = Sampler()(logits, greedy(64))
    assert calls == [logits.shape]
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None


def test_the_sampler_keeps_its_own_path_when_the_logits_change_first(monkeypatch):
    logits = torch.zeros(2, 50)
    logits[:, 7] = 1.0
    monkeypatch.setattr(cpu_argmax, "argmax", lambda x: pytest.fail("took the plain argmax"))
    bias = torch.zeros(2, 50)
    bias[:, 9] = 5.0
    assert Sampler()(logits, greedy(2, logit_bias=bias)).token_ids.tolist() == [9, 9]
    banned = torch.zeros(2, 50, dtype=torch.bool)
    banned[:, 7] = True
    assert 7 not in Sampler()(logits, greedy(2, banned=banned)).token_ids.tolist()
    out = Sampler()(logits, SamplingMetadata(temperature=torch.zeros(2), all_greedy=True, max_num_logprobs=0))
    assert out.token_ids.tolist() == [7, 7] and out.logprobs is not None
