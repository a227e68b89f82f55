"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs) equal transformers' log-softmax at every
prompt position, however the prompt is run: whole, in prefill chunks, after its prefix is in the prefix cache;
and logit_bias steers one request of a batch without touching the others."""

import pytest

from fulcrum import SamplingParams
from fulcrum.errors import InvalidRequestError
from tests.engine.hf_reference import hf_prompt_logprobs
from tests.engine.test_llm_parity import assert_all_blocks_free, make_llm, random_prompts

K = 3


def check_against_hf(folder, prompt, got):
    ref = hf_prompt_logprobs(folder, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:]):
        tok = prompt[i + 1]
        lp, rank = entry[tok]
        assert abs(lp - ref[i, tok].item()) < 1e-4, (i, lp, ref[i, tok].item())
        # 1 = the most likely token; tokens within fp32 noise of it (kernels sum in another order) may fall either side
        above, near = int((ref[i] > ref[i, tok] + 1e-5).sum()), int((ref[i] > ref[i, tok] - 1e-5).sum())
        assert above + 1 <= rank <= near + 1, (rank, above, near)
        top = ref[i].topk(K)
        for v, t in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[t][0] - v) < 1e-4
        assert len(entry) in (K, K + 1)


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_transformers(tiny_model_dir, chunked):
    folder = tiny_model_dir("llama")
    kw = {"max_num_batched_tokens": 16, "block_size": 8} if chunked else {}
    llm = make_llm(folder, **kw)
    prompts = random_prompts(3, 20, 70, seed=21)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # a batch where one request asks for nothing, so rows of both kinds share steps
    outs = llm.generate([*prompts, prompts[0]], [sp, sp, sp, plain], use_tqdm=False)
    for p, o in zip(prompts, outs):
        check_against_hf(folder, p, o.prompt_logprobs)
    assert outs[3].prompt_logprobs is None
    assert outs[3].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(tiny_model_dir):
    folder = tiny_model_dir("llama")
    llm = make_llm(folder, block_size=8)
    prompt = random_prompts(1, 64, 64, seed=22)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    check_against_hf_rank_only(folder, prompt, again.prompt_logprobs)
    assert again.metrics.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hits"] == hits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def check_against_hf_rank_only(folder, prompt, got):
    ref = hf_prompt_logprobs(folder, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:]):
        assert list(entry) == [prompt[i + 1]]  # k = 0: the prompt's own token only
        assert abs(entry[prompt[i + 1]][0] - ref[i, prompt[i + 1]].item()) < 1e-4


def test_logit_bias_forces_and_bans_within_a_batch(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"))
    prompts = random_prompts(4, 10, 30, seed=23)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})
    banned_tok = base[2][0]
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={banned_tok: -100.0})
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3, logit_bias={7: 100.0})
    outs = llm.generate(prompts, [plain, forced, banned, sampled], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == base[0]  # an unbiased row in the same batch is untouched
    assert got[1] == [42] * 6
    assert banned_tok not in got[2] and got[2][0] != base[2][0]
    assert got[3] == [7] * 6


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"


def test_prompt_logprobs_survive_preemption(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompts = random_prompts(8, 20, 40, seed=5)
    # room for about three sequences at a time, prompts in chunks: some are preempted and recomputed
    llm = make_llm(
        folder, block_size=8, kv_cache_memory=20 * 8 * 2 * 2 * 2 * 16 * 4, max_model_len=160, max_num_batched_tokens=16
    )
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        check_against_hf(folder, p, o.prompt_logprobs)  # each prompt token scored once, as when run alone
    assert_all_blocks_free(llm)
