"""The one engine-core client (engine/core_client.py) behind the offline LLM: a request's n samples reach their core
as one message, so their prefills run in the same step every time, under data parallel as in the server (issue 38).
Before, offline data parallel sent one message per sample and the core could step between them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fulcrum.engine.core_client import SyncCoreClient
from fulcrum.engine.llm import LLM
from fulcrum.sampling_params import SamplingParams

# a token budget and a batch size that admit every sample of every prompt at once: only the messages can split them
ENGINE = dict(kv_cache_memory=32 << 20, max_num_batched_tokens=2048, max_num_seqs=128, cpu_threads=1)
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "First Citizen:", "MENENIUS:", "Good morrow", "To be", "KING:", "Nurse!"]


@pytest.fixture(scope="module")
def dp_llm():
    with LLM(data_parallel_size=2, **ENGINE) as llm:
        yield llm


def first_token_steps(llm: LLM, prompts: list[str], params: SamplingParams) -> dict[str, dict[str, float]]:
    """Per request, each sample's first-token time as its core stamped it: one stamp per engine step (the scheduler's
    update), so samples whose prefills ran in the same step share it."""
    seen: dict[str, dict[str, float]] = {}
    step = llm.core.step

    def recording_step():
        outputs = step()
        for o in outputs:
            parent = llm.processor.child_to_parent.get(o.request_id)
            if parent is not None and o.first_token_time is not None:
                seen.setdefault(parent, {}).setdefault(o.request_id, o.first_token_time)
        return outputs

    llm.core.step = recording_step
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.core.step
    assert all(len(r.outputs) == params.n and all(c.token_ids for c in r.outputs) for r in results)
    return seen


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_prefills_a_requests_samples_in_one_step_every_time(dp_llm, n):
    assert isinstance(dp_llm.core, SyncCoreClient)
    params = SamplingParams(n=n, max_tokens=3, temperature=0.8, seed=0, ignore_eos=True)
    split = []
    for _ in range(6):  # each round sends 8 requests while the cores are busy with the ones before
        for parent, times in first_token_steps(dp_llm, PROMPTS, params).items():
            assert len(times) == n
            if len(set(times.values())) != 1:
                split.append((parent, sorted(times.values())))
    assert not split, f"samples of one request prefilled in different steps: {split}"
    assert all(c.given >= n for c in dp_llm.core.cores)  # both cores took requests


def test_a_stop_string_or_an_abort_frees_the_samples_place_on_their_core(dp_llm):
    """The frontend ends these samples itself (the core sends nothing more for a stop string): the client forgets
    them at once, so `fulcrum generate`'s loop ends and the next request goes to the least loaded core."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = dp_llm.generate(["ROMEO:"], greedy, use_tqdm=False)[0].outputs[0].text
    stopped = dp_llm.generate(["ROMEO:"], replace(greedy, n=2, stop=[text[4:7]]), use_tqdm=False)[0]
    assert [c.finish_reason for c in stopped.outputs] == ["stop", "stop"]
    ids = dp_llm.tokenizer("JULIET:")["input_ids"]
    dp_llm.abort(dp_llm.add_request(None, ids, SamplingParams(n=3, max_tokens=1000, ignore_eos=True)))
    assert not dp_llm.core.has_unfinished_requests()
    assert [c.load for c in dp_llm.core.cores] == [0, 0]
