"""Greedy outputs of the engine equal transformers' greedy outputs, however a request is run:
alone, in a batch of 64, in prefill chunks, after a prefix-cache hit, or after preemption."""

import pytest
import torch

from fulcrum import LLM, SamplingParams
from tests.engine.conftest import DEVICES
from tests.engine.hf_reference import hf_greedy
from tests.tiny_models import FAMILIES

N_NEW = 12


def random_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(5, 2048, (n,), generator=g).tolist() for n in lens]


def greedy(max_tokens=N_NEW, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(folder, device="cpu", **kw):
    kw.setdefault("kv_cache_memory", 16 << 20)
    return LLM(model=str(folder), dtype="float32", device=device, seed=0, **kw)


def assert_all_blocks_free(llm) -> None:
    """From the KV cache manager itself: no request holds a block, and every block is back in the free queue."""
    kv = llm.core.kv
    assert not kv.req_blocks
    assert kv.num_free_blocks() == kv.num_blocks
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_blocks"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_alone_and_batched_match_transformers(family, device, tiny_model_dir):
    folder = tiny_model_dir(family)
    prompts = random_prompts(64, 3, 60, seed=1)
    llm = make_llm(folder, device)
    alone = llm.generate([prompts[0]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts, greedy(), use_tqdm=False)
    for i in [0, 1, 17, 63]:
        expected, _ = hf_greedy(folder, prompts[i], N_NEW, device)
        assert batch[i].outputs[0].token_ids == expected, f"prompt {i}"
    assert alone == batch[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-sliding"])
def test_chunked_prefill_matches(family, device, tiny_model_dir):
    folder = tiny_model_dir(family)
    prompts = random_prompts(6, 40, 120, seed=2)
    llm = make_llm(folder, device, max_num_batched_tokens=16, block_size=8)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(folder, p, N_NEW, device)[0]


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_hit_gives_same_tokens_and_skips_work(device, tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    prefix = random_prompts(1, 64, 64, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(4, 5, 20, seed=4)]
    llm = make_llm(folder, device, block_size=16)
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    for p, o in zip(prompts[1:], rest):
        assert o.metrics.num_cached_tokens == 64
        assert o.outputs[0].token_ids == hf_greedy(folder, p, N_NEW, device)[0]
    # the very same prompt again: everything but the last block's tokens is reused
    again = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.metrics.num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert llm.stats()["prefix_cache_hits"] >= 3 * 64
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_recomputes_to_the_same_tokens(device, tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompts = random_prompts(8, 20, 40, seed=5)
    # room for about three sequences at a time: the rest wait or get preempted mid-decode
    llm = make_llm(folder, device, block_size=8, kv_cache_memory=20 * 8 * 2 * 2 * 2 * 16 * 4, max_model_len=160)
    outs = llm.generate(prompts, greedy(max_tokens=40), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(folder, p, 40, device)[0]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_transformers(device, tiny_model_dir):
    folder = tiny_model_dir("llama3-rope-tied-mqa")
    prompt = random_prompts(1, 30, 30, seed=6)[0]
    llm = make_llm(folder, device)
    out = llm.generate([prompt], greedy(logprobs=5), use_tqdm=False)[0].outputs[0]
    tokens, ref = hf_greedy(folder, prompt, N_NEW, device)
    assert out.token_ids == tokens
    assert len(out.logprobs) == N_NEW
    for tok, entry, lp in zip(tokens, out.logprobs, ref):
        assert abs(entry[tok] - lp[tok].item()) <= 1e-4
        top = lp.topk(5)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) <= 1e-4
