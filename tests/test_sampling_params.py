"""SamplingParams refuses, with the field named, what the engine could not carry; the same check serves
the server, `LLM(...)` and `fulcrum generate`."""

import pytest

from fulcrum import SamplingParams
from fulcrum.errors import InvalidRequestError


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),
        ({"seed": True}, "seed"),
        ({"n": True}, "n"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**64}, "top_k"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"top_p": 1e-50}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": 1e-30}, "repetition_penalty"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {"1": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_out_of_range_values_are_refused_with_the_field_named(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
    assert param in str(e.value)


def test_edges_that_are_valid():
    assert SamplingParams(seed=2**63 - 2, n=2).seed == 2**63 - 2
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=10**6).top_k == 10**6  # clamped to the vocabulary by the engine, as vLLM does
    assert SamplingParams(temperature=1e-9).greedy  # below 1e-5 a temperature is greedy
    assert SamplingParams(logit_bias={5: -100.0}).logit_bias == {5: -100.0}
