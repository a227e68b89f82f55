"""The metric arithmetic, checked exactly: a scripted server sends chunks at known (virtual) times and
every figure is compared with the value worked out by hand."""

import asyncio

import aiohttp
import pytest

from fulcrum.bench.client import Target
from fulcrum.bench.loadgen import LoadGenerator, LoadSpec
from fulcrum.bench.metrics import parse_slo, summarize
from fulcrum.bench.workloads import Session
from tests.bench.fake_server import FakeServer, ScriptClock, serving, stream, text_chunk, usage_chunk

SCRIPTS = {
    # r1: 4 one-token chunks 50 ms apart after a 100 ms first token
    "r1": stream(
        (0.100, text_chunk("a")),
        (0.150, text_chunk("b")),
        (0.200, text_chunk("c")),
        (0.250, text_chunk("d")),
        (0.250, usage_chunk(10, 4)),
        done_at=0.260,
    ),
    # r2: 5 tokens in 3 chunks (the server batches tokens into chunks), first one after 200 ms
    "r2": stream(
        (0.0, {"choices": [{"index": 0, "text": "", "finish_reason": None}]}),  # no content: not the first token
        (0.200, text_chunk("ab")),
        (0.300, text_chunk("c")),
        (0.500, text_chunk("de")),
        (0.500, usage_chunk(20, 5)),
        done_at=0.500,
    ),
    # r3: 2 tokens, 10 ms apart
    "r3": stream((0.050, text_chunk("a")), (0.060, text_chunk("b")), (0.060, usage_chunk(30, 2)), done_at=0.060),
    "r4": ("status", 500, '{"error": {"message": "boom", "type": "InternalServerError"}}'),
}


def run_scripted(slo=None, price=None):
    async def main():
        clock = ScriptClock()
        fake = FakeServer(SCRIPTS, clock)
        async with serving(fake) as url, aiohttp.ClientSession() as http:
            gen = LoadGenerator(http, Target(url, "fake-model"), clock=clock)
            sessions = [Session(i, [name], [8], [4]) for i, name in enumerate(["r1", "r2", "r3", "r4"])]
            return await gen.run(LoadSpec(concurrency=1, num_prompts=4), sessions)

    run = asyncio.run(main())
    return run, summarize(run.results, run.duration, slo=slo, price_per_hour=price)


def test_per_request_timings_are_exact():
    run, _ = run_scripted()
    r1, r2, r3, r4 = sorted(run.results, key=lambda r: r.session)
    assert r1.ttft == pytest.approx(0.100) and r1.e2e == pytest.approx(0.250)
    assert r1.itl == pytest.approx([0.05, 0.05, 0.05])
    assert r1.tpot == pytest.approx((0.250 - 0.100) / (4 - 1))
    assert r2.ttft == pytest.approx(0.200)  # the empty first chunk does not count
    assert r2.itl == pytest.approx([0.1, 0.2])
    assert r2.tpot == pytest.approx((0.500 - 0.200) / (5 - 1))  # tokens from usage, not chunks
    assert r3.tpot == pytest.approx(0.010)
    # sessions run one after another: each starts when the previous one's [DONE] arrived
    assert [r.start for r in (r1, r2, r3)] == pytest.approx([0.0, 0.260, 0.760])
    assert not r4.ok and r4.error == "http_500" and r4.error_detail == "boom"
    assert run.duration == pytest.approx(0.820) and run.peak_concurrency == 1


def test_summary_percentiles_throughput_goodput_cost():
    _, s = run_scripted(slo=parse_slo("ttft=150ms,tpot=60ms"), price=3.6)
    assert s["completed"] == 3 and s["failed"] == 1 and s["failures"] == {"http_500": 1}
    # TTFT 100, 200, 50 ms: mean 116.67; linear percentiles over sorted [50, 100, 200]:
    # p50 = 100, p90 = 100 + 0.8 * 100 = 180, p95 = 190, p99 = 198
    ttft = s["ttft_ms"]
    assert ttft["mean"] == pytest.approx(350 / 3)
    assert [ttft["p50"], ttft["p90"], ttft["p95"], ttft["p99"]] == pytest.approx([100, 180, 190, 198])
    # ITL pooled: r1 50,50,50; r2 100,200; r3 10 -> sorted [10,50,50,50,100,200]
    # p50 = 50, p90 at rank 4.5 = 150, p99 at rank 4.95 = 195
    itl = s["itl_ms"]
    assert itl["mean"] == pytest.approx(460 / 6)
    assert [itl["p50"], itl["p90"], itl["p99"]] == pytest.approx([50, 150, 195])
    # TPOT 50, 75, 10 ms; E2E 250, 500, 60 ms
    assert s["tpot_ms"]["p50"] == pytest.approx(50) and s["tpot_ms"]["mean"] == pytest.approx(45)
    assert s["e2e_ms"]["p50"] == pytest.approx(250) and s["e2e_ms"]["p99"] == pytest.approx(250 + 0.98 * 250)
    # 3 requests, 11 output tokens, 60 prompt tokens in 0.82 s
    assert s["request_throughput"] == pytest.approx(3 / 0.82)
    assert s["output_throughput"] == pytest.approx(11 / 0.82)
    assert s["total_token_throughput"] == pytest.approx(71 / 0.82)
    assert s["token_source"] == {"usage": 3}
    # SLO ttft<=150ms and tpot<=60ms: r1 (100, 50) and r3 (50, 10) pass, r2 (200 ms TTFT) misses
    assert s["goodput"] == pytest.approx(2 / 0.82)
    assert s["slo_attainment"] == pytest.approx(2 / 4)
    # $3.60/h = $0.001/s; 11/0.82 tok/s -> 0.001 / (11/0.82) * 1e6 dollars per 1M tokens
    assert s["cost_per_1m_output_tokens"] == pytest.approx(0.001 / (11 / 0.82) * 1e6)
    assert s["cost_per_1m_total_tokens"] == pytest.approx(0.001 / (71 / 0.82) * 1e6)


def test_slo_parsing_units_and_errors():
    assert parse_slo("ttft=200ms,tpot=0.05s,e2e=2") == {"ttft": 0.2, "tpot": 0.05, "e2e": 2.0}
    with pytest.raises(ValueError, match="unknown SLO"):
        parse_slo("latency=1s")
    with pytest.raises(ValueError, match="bad SLO value"):
        parse_slo("ttft=fast")
