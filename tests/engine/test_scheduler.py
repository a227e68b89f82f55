"""The token budget: decodes first, prefill chunks with what is left, priorities."""

from fulcrum.config import EngineConfig
from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.request import Request
from fulcrum.engine.scheduler import Scheduler
from fulcrum.sampling_params import SamplingParams


def make(budget=32, seqs=8, blocks=100, max_model_len=2048, **kw):
    kv = KVCacheManager(blocks, 4)
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=4, device="cpu", **kw)
    return Scheduler(config, max_model_len, kv)


def run_step(s, out):
    s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples_next_token})


def test_long_prompt_is_chunked_and_decodes_keep_going():
    s = make(budget=32)
    short = [Request(f"s{i}", [1] * 6, SamplingParams(max_tokens=50)) for i in range(3)]
    for r in short:
        s.add_request(r)
    run_step(s, s.schedule())  # prefill the three short prompts
    s.add_request(Request("long", [2] * 100, SamplingParams(max_tokens=5)))
    for _ in range(3):
        out = s.schedule()
        sizes = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
        assert all(sizes[r.request_id] == 1 for r in short)  # every decode runs every step
        assert sizes["long"] == 32 - 3  # the prompt gets the rest of the budget
        assert out.num_batched_tokens <= 32
        run_step(s, out)


def test_without_chunked_prefill_a_long_prompt_runs_whole_in_one_step():
    s = make(budget=32, enable_chunked_prefill=False, max_model_len=200)
    short = [Request(f"s{i}", [1] * 6, SamplingParams(max_tokens=50)) for i in range(3)]
    for r in short:
        s.add_request(r)
    run_step(s, s.schedule())
    s.add_request(Request("long", [2] * 100, SamplingParams(max_tokens=5)))
    out = s.schedule()
    sizes = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    assert sizes == {"s0": 1, "s1": 1, "s2": 1, "long": 100}  # the decodes wait for the whole prompt
    run_step(s, out)
    assert s.schedule().num_batched_tokens == 4  # then all four decode


def test_priority_then_arrival_order():
    s = make(budget=6, seqs=8)
    s.add_request(Request("late-important", [1] * 6, SamplingParams(), priority=-1, arrival_time=2.0))
    s.add_request(Request("early", [1] * 6, SamplingParams(), arrival_time=1.0))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["late-important"]


def test_max_num_seqs_caps_the_batch():
    s = make(budget=1000, seqs=2)
    for i in range(5):
        s.add_request(Request(f"r{i}", [1] * 4, SamplingParams()))
    assert len(s.schedule().scheduled) == 2


def test_preemption_frees_the_latest_request():
    s = make(budget=100, seqs=8, blocks=4)  # 16 token slots
    a = Request("a", [1] * 7, SamplingParams(max_tokens=20), arrival_time=1.0)
    b = Request("b", [1] * 7, SamplingParams(max_tokens=20), arrival_time=2.0)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        run_step(s, s.schedule())
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert b in s.waiting and b.num_computed_tokens == 0
