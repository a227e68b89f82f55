"""An LLM's end (issue 37): close(), a `with` block or dropping it stops its workers, its grammar threads and this
process's torch.distributed group, so that an engine of another parallel layout starts after it in the same process;
a closed LLM refuses work with EngineClosedError; a parallel LLM started while another holds the group runs its core
in a process of its own and gives the same tokens."""

from __future__ import annotations

import gc
import threading

import pytest
import torch.distributed as dist

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.distributed import parallel_state
from fulcrum.engine.core_client import SyncCoreClient
from fulcrum.engine.llm import LLM
from fulcrum.engine.workers import Workers
from fulcrum.errors import EngineClosedError, ModelLoadError
from fulcrum.sampling_params import SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ENGINE = dict(kv_cache_memory=32 << 20, max_num_batched_tokens=40, cpu_threads=1)


def tokens(llm: LLM) -> list[int]:
    return llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def worker_processes(llm: LLM) -> list:
    return [w.handle for w in llm.core.workers.workers]


def assert_released(procs: list) -> None:
    """Every worker has exited and nothing holds this process's torch.distributed any more."""
    assert procs and not any(p.is_alive() for p in procs)
    assert not dist.is_initialized() and not parallel_state.held(2)


def test_a_closed_llm_refuses_work_and_stops_its_grammar_threads():
    llm = LLM(**ENGINE)
    choice = SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=["ay", "no"])
    )
    assert llm.generate(["ROMEO:"], choice, use_tqdm=False)[0].outputs[0].text in ("ay", "no")
    grammar_threads = [t for t in threading.enumerate() if t.name.startswith("fulcrum-grammar")]
    assert grammar_threads  # the compile ran on one
    llm.close()
    llm.close()  # idempotent
    for t in grammar_threads:
        t.join(5)
        assert not t.is_alive()
    for use in (
        lambda: llm.generate(["ROMEO:"], GREEDY),
        llm.stats,
        lambda: llm.chat([{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(EngineClosedError, match="this LLM was closed"):
            use()
    assert "closed" in repr(llm)
    with LLM(**ENGINE) as again:
        assert tokens(again)
    with pytest.raises(EngineClosedError):
        tokens(again)


def test_tensor_parallel_closed_then_pipeline_parallel_in_a_with_block():
    tp = LLM(tensor_parallel_size=2, **ENGINE)
    want = tokens(tp)
    procs = worker_processes(tp)
    tp.close()
    assert_released(procs)
    with pytest.raises(EngineClosedError):
        tokens(tp)
    with LLM(pipeline_parallel_size=2, **ENGINE) as pp:
        assert tokens(pp) == want
        procs = worker_processes(pp)  # in this process again: rank 0 is here, its worker a child
    assert_released(procs)


def test_a_deleted_parallel_llm_releases_its_workers_and_group():
    tp = LLM(tensor_parallel_size=2, **ENGINE)
    want = tokens(tp)
    procs = worker_processes(tp)
    del tp
    gc.collect()
    assert_released(procs)
    pp = LLM(pipeline_parallel_size=2, **ENGINE)
    try:
        assert tokens(pp) == want
    finally:
        pp.close()


def test_a_second_engine_beside_a_parallel_one_runs_its_core_in_a_process_of_its_own(caplog):
    tp = LLM(tensor_parallel_size=2, **ENGINE)
    try:
        want = tokens(tp)
        with caplog.at_level("INFO", logger="fulcrum.engine.llm"):
            pp = LLM(pipeline_parallel_size=2, **ENGINE)
        assert "tensor_parallel_size=2" in caplog.text and "process of its own" in caplog.text
        try:
            assert isinstance(pp.core, SyncCoreClient)
            assert tokens(pp) == want
            assert tokens(tp) == want  # the first is untouched
            core_procs = [c.proc for c in pp.core.cores]
        finally:
            pp.close()
        assert not any(p.is_alive() for p in core_procs)
        # an engine core built directly cannot take the group either: refused before it starts anything, and the
        # first engine goes on
        config = EngineConfig(pipeline_parallel_size=2, **ENGINE)
        model = ModelConfig.from_path(config.model, config.dtype, config.max_model_len)
        with pytest.raises(ModelLoadError, match="torch.distributed group is already held"):
            Workers(config, model)
        assert tokens(tp) == want
    finally:
        tp.close()
