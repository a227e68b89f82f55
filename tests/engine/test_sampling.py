"""Sampling behaviour a user relies on: seeds, n, top-k/p, penalties, min_tokens, stops, errors."""

import pytest

from fulcrum import SamplingParams
from fulcrum.errors import InvalidRequestError
from tests.engine.test_llm_parity import make_llm, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir("llama"))


def test_seeded_request_is_the_same_alone_and_in_a_batch(llm):
    prompts = random_prompts(16, 5, 40, seed=10)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[3]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True)
    params = [others] * 16
    params[3] = sp
    batched = llm.generate(prompts, params, use_tqdm=False)[3].outputs[0].token_ids
    assert alone == batched
    other_seed = llm.generate([prompts[3]], SamplingParams(**{**vars(sp), "seed": 99}), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_and_differ(llm):
    prompt = random_prompts(1, 48, 48, seed=11)[0]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=5), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.stats()["prefix_cache_hits"] >= 3 * 32  # samples 2..4 reuse the prompt's full blocks


def test_top_k_one_is_greedy(llm):
    prompts = random_prompts(4, 5, 30, seed=12)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(
        prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_presence_penalty_prevents_repeats(llm):
    prompt = random_prompts(1, 10, 10, seed=13)[0]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    penalized = (
        llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=2.0, repetition_penalty=1.0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(penalized)) > len(set(plain))


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts(1, 10, 10, seed=14)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]), use_tqdm=False)
    o = out[0].outputs[0]
    assert o.token_ids == tokens[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_at
    # min_tokens bans the stop token until it is reached
    later = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(later.token_ids) >= first + 2 and stop_at not in later.token_ids[: first + 1]


def test_length_finish_and_timings(llm):
    out = llm.generate([random_prompts(1, 8, 8)[0]], SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 7
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -5),
        ("n", 0),
        ("max_tokens", 0),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 50),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in str(err.value)


def test_too_long_prompts_are_rejected_and_the_engine_goes_on(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        llm.generate([list(range(5, 69))], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_tokens") as err:
        llm.generate([list(range(5, 35))], SamplingParams(max_tokens=40), use_tqdm=False)
    assert err.value.param == "max_tokens"
    out = llm.generate([list(range(5, 35))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_abort_frees_blocks(llm):
    prompts = random_prompts(4, 20, 40, seed=15)
    ids = [llm.add_request(None, p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in prompts]
    for _ in range(3):
        llm.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_blocks"]
    for rid in ids:
        llm.abort(rid)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    assert not llm.core.has_unfinished_requests()


def test_top_k_above_the_vocabulary_is_the_whole_vocabulary(llm):
    prompt = random_prompts(1, 10, 10, seed=30)[0]
    base = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    off = llm.generate([prompt], base, use_tqdm=False)[0].outputs[0].token_ids
    huge = llm.generate([prompt], SamplingParams(**{**vars(base), "top_k": 5000}), use_tqdm=False)
    assert huge[0].outputs[0].token_ids == off


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"stop_token_ids": [999999], "min_tokens": 2}, "stop_token_ids"),
        ({"logit_bias": {2048: 1.0}}, "logit_bias"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(llm, kw, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    assert e.value.param == param
    assert not llm.core.has_unfinished_requests()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_logit_bias_moves_greedy_decoding(llm):
    prompt = random_prompts(1, 10, 10, seed=31)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [42] * 5


def test_a_bad_prompt_late_in_the_list_leaves_none_queued(llm):
    prompts = [*random_prompts(3, 5, 10, seed=32), [5, 99999]]
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.core.has_unfinished_requests()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
