"""Async scheduling (--async-scheduling): the next step is scheduled and launched before the step in flight is read
back. Checked on CPU with a delayed executor (each launched step's results take a while to come back, as a GPU's
would): the launches run ahead of the read-backs, and every request gets the tokens a synchronous run gives it."""

import time

import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.config import DEFAULT_MODEL
from tests.engine.conftest import DEVICES

BUNDLED = str(DEFAULT_MODEL)
PROMPTS = ["ROMEO:", "To be, or not to be", "KING HENRY:\nOnce more unto the breach, dear friends", "O"]


def make_llm(async_scheduling: bool, device: str = "cpu", **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 16 << 20)
    return LLM(model=BUNDLED, dtype="float32", device=device, seed=0, async_scheduling=async_scheduling, **kw)


def delayed(llm: LLM, delay: float = 0.002) -> list[tuple[str, int]]:
    """Make every launched step's results come back `delay` seconds late; returns the log of launches and
    read-backs, in order."""
    runner, log = llm.core.runner, []
    launch = runner.launch

    def delayed_launch(sched, prev=None):
        pending = launch(sched, prev)
        n = sum(1 for kind, _ in log if kind == "launch")
        log.append(("launch", n))
        read = pending.result

        def result():
            time.sleep(delay)  # the device still at work
            log.append(("result", n))
            return read()

        pending.result = result
        return pending

    runner.launch = delayed_launch
    return log


def tokens(llm: LLM, params) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


PARAMS = {
    "greedy, lengths differ": [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 7, 20, 13)],
    "stops at eos": SamplingParams(temperature=0, max_tokens=60),
    "seeded samples, n=2": SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=16, ignore_eos=True),
    "min_tokens and logprobs": SamplingParams(temperature=0, max_tokens=24, min_tokens=20, logprobs=2),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(PARAMS))
def test_async_steps_give_the_synchronous_tokens(case, device):
    """On CUDA also through the captured graphs, the tokens in flight copied into their static inputs."""
    want = tokens(make_llm(False, device), PARAMS[case])
    llm = make_llm(True, device)
    log = delayed(llm)
    assert tokens(llm, PARAMS[case]) == want
    assert llm.core.in_flight is None and not llm.core.scheduler.running
    # steady decode: step k + 1 was launched before step k was read back
    ahead = sum(log.index(("launch", k + 1)) < log.index(("result", k)) for k in range(len(log) // 2 - 1))
    assert ahead >= len(log) // 2 - 2


def test_chunked_prefill_and_preemption_under_async_steps():
    """A small cache and step budget: prompts are chunked beside running decodes and requests are preempted while
    their tokens are in flight; the tokens still equal the synchronous run's."""
    kw = dict(max_num_batched_tokens=8, block_size=4, kv_cache_memory=18 * 4 * 8 * 2 * 4 * 32 * 4, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    sync = make_llm(False, **kw)
    want = tokens(sync, params)
    llm = make_llm(True, **kw)
    delayed(llm)
    assert tokens(llm, params) == want
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.kv.stats().num_used_blocks == 0  # nothing leaked


def test_a_grammar_request_drains_the_step_in_flight():
    """Structured output needs each token on the host before the next mask: those steps run synchronously, the
    others overlap, and both kinds of request get their synchronous tokens."""
    from fulcrum.sampling_params import StructuredOutputsParams

    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}")),
    ]
    prompts = PROMPTS[:2]
    want = [o.outputs[0].token_ids for o in make_llm(False).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_abort_while_in_flight_frees_the_request():
    llm = make_llm(True)
    core = llm.core
    core.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    core.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.in_flight is not None
    done = core.abort_requests(["a"])
    assert [o.finish_reason for o in done] == ["abort"]
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert not any(o.request_id == "a" for o in outs)  # its token in flight was dropped, no second final output
    assert [o.finish_reason for o in outs if o.request_id == "b"][-1] == "length"
    assert core.kv.stats().num_used_blocks == 0
