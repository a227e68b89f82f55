"""CUDA-graph decode steps: the bucket and padding logic (plain Python), the padded static buffers run eagerly on CPU
through the Triton kernels (what a replay computes), and capture itself on CUDA only."""

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.config import DEFAULT_MODEL
from fulcrum.engine import cuda_graphs, step_inputs
from fulcrum.engine.cuda_graphs import DecodeGraphs, bucket, capture_sizes, graphable, pad
from fulcrum.engine.scheduler import SchedulerOutput
from fulcrum.engine.step_inputs import StepInputs
from fulcrum.kernels.triton import BACKEND_ENV

BUNDLED = str(DEFAULT_MODEL)


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(64)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(65, sizes) is None


def decode_step(n: int, ctx: int = 5) -> StepInputs:
    return StepInputs(
        ids=list(range(3, 3 + n)),
        positions=[ctx - 1] * n,
        slots=[16 * (i + 1) + ctx - 1 for i in range(n)],
        query_lens=[1] * n,
        decode_idx=list(range(n)),
        decode_tables=[[i + 1] for i in range(n)],
        decode_ctx=[ctx] * n,
        logits_rows=list(range(n)),
        last_idx=list(range(n)),
    )


def test_only_plain_decode_steps_are_graphable():
    assert graphable(decode_step(3))
    mixed = decode_step(2)
    mixed.prefills = [(2, 4, 4, 0)]
    assert not graphable(mixed)
    logprobs = decode_step(2)
    logprobs.num_prompt_rows = 1
    assert not graphable(logprobs)
    assert not graphable(StepInputs())


def test_padding_rows_write_nothing_and_read_nothing():
    p = pad(decode_step(3), 8)
    assert p.size == 8 and len(p.ids) == len(p.slots) == len(p.context_lens) == len(p.block_tables) == 8
    assert p.slots[3:] == [-1] * 5 and p.context_lens[3:] == [0] * 5
    assert p.slots[:3] == decode_step(3).slots


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")


def schedule_decodes(llm: LLM, prompts: list[list[int]]) -> SchedulerOutput:
    """Prefill `prompts` through the engine, then the scheduler's next step: one decode row for each."""
    core = llm.core
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    core.step()  # the prefills
    out = core.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in out.scheduled)
    return out


def test_padded_static_buffers_give_the_eager_logits(triton_backend):
    """3 decode rows padded to a bucket of 4 over the static buffers: the same logits as the step's own eager
    forward, and the padding row writes no KV slot (the cache holds exactly what the eager step wrote)."""
    llm = LLM(model=BUNDLED, dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory=16 << 20)
    runner = llm.core.runner
    out = schedule_decodes(llm, [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]])
    si = step_inputs.build(out.scheduled, runner.block_size, runner.decode_rows)
    assert cuda_graphs.supported(runner.model) is None
    graphs = DecodeGraphs(runner.model, runner.device, [2, 4], max_blocks=8)
    assert graphs.fits(si)
    cache_before = runner.kv_cache.clone()
    with torch.inference_mode():
        padded = graphs.run_eagerly(si)
        cache_padded = runner.kv_cache.clone()
        runner.kv_cache.copy_(cache_before)
        (eager,) = runner.forward_logits([si])
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    # by slot: the real rows' slots hold what the eager step wrote (4 rows against 3 through the linears may round
    # differently), every other slot is untouched
    slots = lambda c: c.flatten(2, 3).transpose(0, 2)  # noqa: E731  [slots, 2, layers, kv_heads, head_dim]
    written = torch.zeros(slots(cache_before).shape[0], dtype=torch.bool)
    written[si.slots] = True
    assert not torch.equal(slots(cache_before)[written], slots(runner.kv_cache)[written])
    torch.testing.assert_close(slots(cache_padded)[written], slots(runner.kv_cache)[written], rtol=1e-5, atol=1e-5)
    assert torch.equal(slots(cache_padded)[~written], slots(cache_before)[~written])


def test_steps_wider_than_the_buffers_run_eagerly():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes, graphs.max_blocks = [1, 2, 4], 2
    assert graphs.fits(decode_step(4))
    assert not graphs.fits(decode_step(5))  # more rows than the largest bucket
    wide = decode_step(2)
    wide.decode_tables = [[1, 2, 3], [4]]
    assert not graphs.fits(wide)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_give_the_eager_tokens():
    prompts = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 60))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(model=BUNDLED, dtype="float32", device="cuda", max_num_seqs=4, kv_cache_memory=16 << 20)
    graphed = LLM(**kw)
    assert graphed.core.runner.graphs is not None
    replays = 0
    run = graphed.core.runner.graphs.run

    def counted(si):
        nonlocal replays
        replays += 1
        return run(si)

    graphed.core.runner.graphs.run = counted
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert replays > 30
    del graphed
    eager = LLM(**kw, enforce_eager=True)
    assert eager.core.runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
