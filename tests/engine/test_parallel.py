"""Tensor, pipeline and expert parallel (engine/workers.py): one model over 2-4 processes on this machine gives
the greedy tokens of one process, alone and batched, with chunked prefill and a prefix-cache hit; each rank holds
its share of the weights and of the KV cache; sizes that cannot split the model fail before anything starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fulcrum.config import DEFAULT_MODEL
from fulcrum.engine.llm import LLM
from fulcrum.errors import EngineDeadError, ModelLoadError
from fulcrum.layers.moe import FusedExperts
from fulcrum.sampling_params import SamplingParams
from tests.servers import niceness

DRAFT = DEFAULT_MODEL.parent / "tiny-shakespeare-draft"
SPEECH = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and arrows of "
    "outrageous fortune, Or to take arms against a sea of troubles And by opposing end them. To die, to sleep, No "
    "more; and by a sleep to say we end The heart-ache and the thousand natural shocks That flesh is heir to."
)
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak.", SPEECH]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# a budget below the speech's length, so that it is prefilled in chunks mixed with the others' decodes
ENGINE = dict(kv_cache_memory=32 << 20, max_num_batched_tokens=40, cpu_threads=1, enable_prefix_caching=True)


def run(llm: LLM) -> dict:
    """What a user sees: tokens of a batch, of one prompt alone, and of the speech again (a prefix-cache hit)."""
    batch = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    alone = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    again = llm.generate([SPEECH], GREEDY, use_tqdm=False)[0]
    return {
        "batch": [o.outputs[0].token_ids for o in batch],
        "alone": alone[0].outputs[0].token_ids,
        "again": again.outputs[0].token_ids,
        "cached": again.metrics.num_cached_tokens,
        "weight_bytes": llm.core.runner.weight_bytes,
        "bytes_per_block": llm.core.runner.bytes_per_block,
        "num_blocks": llm.core.kv.num_blocks,
        "free_blocks": llm.core.kv.num_free_blocks(),
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    out = {}
    for name, model in (("dense", str(DEFAULT_MODEL)), ("moe", str(tiny_model_dir("mixtral")))):
        llm = LLM(model, **ENGINE)
        out[name] = run(llm)
    return out


CASES = [
    ("dense", 2, 1, False, None),
    ("dense", 1, 2, False, "5,3"),  # an uneven partition: rank 0, the last stage, holds layers 5-7
    ("dense", 2, 2, False, None),
    ("moe", 2, 1, True, None),
    ("moe", 1, 2, False, None),
    ("moe", 2, 2, True, None),
]


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "ep", "partition"), CASES,
    ids=[f"{k}-tp{t}-pp{p}{'-ep' if e else ''}" for k, t, p, e, _ in CASES],
)  # fmt: skip
def test_parallel_engine_gives_the_tokens_of_one_process(reference, tiny_model_dir, kind, tp, pp, ep, partition):
    model = str(DEFAULT_MODEL) if kind == "dense" else str(tiny_model_dir("mixtral"))
    llm = LLM(
        model, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
        pp_layer_partition=partition, **ENGINE,
    )  # fmt: skip
    try:
        got = run(llm)
        stack = llm.core.runner.model.model
        experts = [m for m in stack.modules() if isinstance(m, FusedExperts)]
    finally:
        llm.shutdown()
    ref = reference[kind]
    assert got["batch"] == ref["batch"]
    assert got["alone"] == ref["alone"] == ref["batch"][1]
    assert got["again"] == ref["again"] and got["cached"] >= 16  # the speech's blocks were found in the cache
    # rank 0 holds its heads of its stage's layers: a KV block costs it 1/(tp * pp) of one process's
    layers = stack.end - stack.start
    assert got["bytes_per_block"] * tp * len(stack.layers) == ref["bytes_per_block"] * layers
    assert got["weight_bytes"] < ref["weight_bytes"] * (0.6 if tp * pp == 2 else 0.4)
    assert got["free_blocks"] == got["num_blocks"]  # every block back after the requests
    if partition:
        assert (stack.start, stack.end) == (5, 8)
    for e in experts:  # gate and up of intermediate 128: EP holds 4 of the 8 experts whole, TP a half of each of the 8
        assert tuple(e.gate_up_proj.weight.shape[:2]) == ((4, 256) if ep else (8, 256 // tp))


@pytest.mark.parametrize(
    ("sizes", "spec"),
    [
        (dict(tensor_parallel_size=2), {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 3}),
        (dict(pipeline_parallel_size=2), {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ],
    ids=["tp2-draft", "pp2-ngram"],
)
def test_speculative_decoding_on_a_parallel_engine_keeps_the_greedy_tokens(reference, sizes, spec):
    """The draft model runs whole beside rank 0; the target verifies its proposals across the ranks."""
    spec = {**spec, "disable_by_batch_size": None}
    llm = LLM(speculative_config=spec, **sizes, **ENGINE)
    try:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == reference["dense"]["batch"]
    assert stats["spec_num_draft_tokens"] > 0  # it did speculate


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(tensor_parallel_size=3), "num_attention_heads=8 is not divisible by tensor_parallel_size=3"),
        (dict(pipeline_parallel_size=9), "pipeline_parallel_size 9 is more than the model's 8 layers"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="4,3"), "add up to the model's 8 layers"),
    ],
)
def test_sizes_that_cannot_split_the_model_fail_at_startup(sizes, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(**sizes, **ENGINE)


def test_data_parallel_llm_splits_a_batch_between_two_cores():
    """LLM(data_parallel_size=2): two engine-core processes, each its own KV cache; a batch is split between them
    and the answers are those of one engine."""
    ref = run_batch(LLM(**ENGINE))
    llm = LLM(data_parallel_size=2, **ENGINE)
    try:
        assert run_batch(llm) == ref
        given = [c.given for c in llm.core.cores]
        assert all(n >= 1 for n in given), given  # both cores took requests
        assert llm.stats()["num_blocks"] == 2 * LLM(**ENGINE).stats()["num_blocks"]  # two caches
    finally:
        llm.shutdown()


def run_batch(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)]


def test_a_dead_worker_ends_the_engine_instead_of_hanging():
    llm = LLM(tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        worker = llm.core.workers.workers[0].handle
        # a worker of the caller's own engine computes at the caller's priority (only `fulcrum serve`'s are niced)
        assert niceness(worker.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        time.sleep(0.5)  # the watcher's poll
        with pytest.raises(EngineDeadError, match="worker 1 exited"):
            llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
