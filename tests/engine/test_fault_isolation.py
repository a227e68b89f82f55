"""One request that fails inside a step ends with an error; the requests batched with it, and the
engine, go on as if it had never been there."""

import pytest
import torch

from fulcrum import SamplingParams
from fulcrum.errors import is_fatal
from tests.engine.test_llm_parity import assert_all_blocks_free, greedy, make_llm, random_prompts

POISON = 4  # a prompt starting with this token id makes the (patched) forward fail


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir("llama"))


@pytest.fixture
def poisoned(llm, monkeypatch):
    """The runner fails any step whose batch holds a poisoned request, as a bad input would make it."""
    real = llm.core.runner.execute
    calls = []

    def execute(sched):
        calls.append(len(sched.scheduled))
        if any(s.request.prompt_token_ids[0] == POISON for s in sched.scheduled):
            raise RuntimeError("index 4999 is out of bounds for dimension 1 with size 2048")
        return real(sched)

    monkeypatch.setattr(llm.core.runner, "execute", execute)
    return calls


def test_a_failing_request_ends_with_an_error_and_the_batch_goes_on(llm, poisoned):
    prompts = random_prompts(6, 5, 40, seed=21)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    bad = [POISON, *prompts[2][1:]]
    mixed = [*prompts[:2], bad, *prompts[3:]]
    out = llm.generate(mixed, greedy(), use_tqdm=False)
    assert out[2].outputs[0].finish_reason == "error"
    assert "out of bounds" in out[2].outputs[0].error
    assert out[2].outputs[0].token_ids == []
    for i in (0, 1, 3, 4, 5):
        assert out[i].outputs[0].token_ids == clean[i], i
        assert out[i].outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)
    # the engine still serves, the same greedy text as before
    again = llm.generate(prompts[:2], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == clean[:2]


def test_seeded_neighbours_draw_the_same_tokens_after_a_retried_step(llm, poisoned):
    prompt = random_prompts(1, 20, 20, seed=22)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=77, ignore_eos=True)
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([prompt, [POISON, 5, 6]], [sp, greedy()], use_tqdm=False)
    assert out[0].outputs[0].token_ids == alone
    assert out[1].outputs[0].finish_reason == "error"
    assert_all_blocks_free(llm)


def test_state_corrupting_failures_are_fatal():
    assert is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal(KeyboardInterrupt())
    assert not is_fatal(RuntimeError("index 4999 is out of bounds for dimension 1 with size 2048"))
    assert not is_fatal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
