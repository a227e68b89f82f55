"""A request that fails after producing tokens, read by a frontend that fell behind the engine (its tokens and the
failure arrive together): the stream still gets those tokens, unfinished, before the error, and the request is
released. The engine core is a stand-in that delivers both core outputs at once, so the order is deterministic;
the frontend (AsyncLLM's output loop, output processor, detokenizer and generate) is the real one."""

import asyncio

import pytest

from fulcrum.config import EngineConfig
from fulcrum.engine.async_llm import AsyncLLM
from fulcrum.engine.messages import CoreOutputs, CoreReady, SchedulerStats
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.errors import RequestFailedError
from fulcrum.sampling_params import SamplingParams


class BehindCore:
    """The core's side: on add, one step's two tokens and then the request's failure, both queued before the
    frontend reads either."""

    alive = True
    latest_stats = SchedulerStats()

    def __init__(self, tokens: list[int]):
        self.tokens, self.out, self.aborted = tokens, asyncio.Queue(), []

    def add_requests(self, samples):
        rid = samples[0].request_id
        step = EngineCoreOutput(rid, list(self.tokens), arrival_time=1.0, first_token_time=1.1, num_prompt_tokens=3)
        failed = EngineCoreOutput(rid, [], finish_reason="error", error="injected fault", arrival_time=1.0)
        for out in (step, failed):
            self.out.put_nowait(CoreOutputs(outputs=[out], stats=SchedulerStats()))

    async def get_output(self):
        return await self.out.get()

    def abort_requests(self, ids):
        self.aborted += ids

    def finish_requests(self, ids):
        pass


def test_tokens_read_together_with_a_failure_are_streamed_before_the_error():
    async def scenario():
        llm = AsyncLLM(EngineConfig())  # the bundled model's tokenizer
        text = llm.tokenizer.decode([40, 41])
        llm.client = core = BehindCore([40, 41])
        llm.ready = CoreReady(max_model_len=1024, vocab_size=llm.tokenizer.vocab_size)
        llm._loop_task = asyncio.create_task(llm._output_loop())
        got = []
        with pytest.raises(RequestFailedError, match="injected fault"):
            async for ro, deltas in llm.generate("abc", [5, 6, 7], SamplingParams(max_tokens=5), request_id="r1"):
                got.append((ro.finished, ro.outputs[0].finish_reason, list(ro.outputs[0].token_ids), deltas[0]))
        llm._loop_task.cancel()
        return got, text, core.aborted, dict(llm.queues), dict(llm.processor.parents)

    got, text, aborted, queues, parents = asyncio.run(scenario())
    # one item before the error: the step's tokens and their text, not finished, no finish reason
    assert got == [(False, None, [40, 41], text)]
    # released: its queue and its output state; the core ended it itself, so nothing is aborted
    assert queues == {} and parents == {} and aborted == []
