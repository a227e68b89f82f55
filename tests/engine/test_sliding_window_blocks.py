"""Sliding-window models release the KV blocks that fall out of the window (issue 16): a long sequence holds a
bounded number of blocks, the tokens stay transformers' greedy tokens, and sequences that would not fit whole
run side by side without preemption. A model with a global layer keeps every block."""

import pytest

from tests.engine.hf_reference import hf_greedy
from tests.engine.test_llm_parity import assert_all_blocks_free, greedy, make_llm, random_prompts

WINDOW, BS = 8, 4  # the tiny sliding models' window, and a block size that puts several blocks in it
BOUND = WINDOW // BS + 2  # the window's blocks, one partly behind it, and the one being written


def held(llm, request_id):
    kv = llm.core.kv
    return kv.num_held_blocks(request_id)


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_long_sequence_holds_a_window_of_blocks(tiny_model_dir, chunk):
    folder = tiny_model_dir("mistral-sliding")
    kw = dict(block_size=BS, max_model_len=256)
    if chunk:
        kw["max_num_batched_tokens"] = chunk
    llm = make_llm(folder, **kw)
    assert llm.core.kv.sliding_window == WINDOW
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    rid = llm.add_request(None, prompt, greedy(max_tokens=120))
    child, most, last = f"{rid}-0", 0, None
    while llm.core.has_unfinished_requests():
        for ro, _ in llm.step():
            last = ro
        if child in llm.core.scheduler.requests:
            most = max(most, held(llm, child))
    assert most <= BOUND + (chunk or len(prompt)) // BS  # a prefill step writes its whole chunk first
    assert last.outputs[0].token_ids == hf_greedy(folder, prompt, 120)[0]
    assert_all_blocks_free(llm)


def test_sequences_too_long_to_fit_whole_run_without_preemption(tiny_model_dir):
    folder = tiny_model_dir("mistral-sliding")
    # 64 blocks of 4 tokens: 256 tokens, where 4 sequences of 30 + 150 would take 720 whole
    per_block = make_llm(folder, block_size=BS, max_model_len=256).core.runner.bytes_per_block
    llm = make_llm(folder, block_size=BS, max_model_len=256, kv_cache_memory=64 * per_block)
    assert llm.core.kv.num_blocks == 64
    prompts = random_prompts(4, 30, 30, seed=4)
    outs = llm.generate(prompts, greedy(max_tokens=150), use_tqdm=False)
    assert llm.stats()["num_preemptions"] == 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(folder, p, 150)[0]
    assert_all_blocks_free(llm)


def test_a_model_with_global_layers_keeps_its_blocks(tiny_model_dir):
    llm = make_llm(tiny_model_dir("gemma2"), block_size=BS)
    assert llm.core.kv.sliding_window is None
