"""The load generator against a scripted server: closed and open loops, duration, interruption,
multi-turn history, every way a server can misbehave recorded as a failure, never a crash, and
every request ended by its deadline, never waited on forever."""

import asyncio

import aiohttp
import numpy as np
import pytest

from fulcrum.bench.client import Target
from fulcrum.bench.loadgen import LoadGenerator, LoadSpec, arrival_gaps
from fulcrum.bench.metrics import summarize
from fulcrum.bench.workloads import Session
from tests.bench.fake_server import STALL, FakeServer, serving, stream, text_chunk, until_gone, usage_chunk

QUICK = stream((0.0, text_chunk("x")), (0.0, text_chunk("y")), (0.0, usage_chunk(3, 2)), done_at=0.0)
HELD = stream((0.05, text_chunk("x")), (0.0, text_chunk("y")), (0.0, usage_chunk(3, 2)), done_at=0.0)
SLOW = stream(*[(0.05, text_chunk("x"))] * 100, done_at=0.0)


def run(scripts, load, sessions, endpoint="completions", stop_after=None, **kw):
    async def main():
        fake = FakeServer(scripts)
        async with serving(fake) as url, aiohttp.ClientSession() as http:
            gen = LoadGenerator(http, Target(url, "fake-model", endpoint), **kw)
            stop = asyncio.Event()
            if stop_after is not None:
                asyncio.get_running_loop().call_later(stop_after, stop.set)
            return await gen.run(load, sessions, stop), fake

    return asyncio.run(main())


def singles(names):
    return [Session(i, [n], [4], [1]) for i, n in enumerate(names)]


def test_misbehaving_servers_become_failures_by_class():
    scripts = {
        "ok": QUICK,
        "error-body": ("status", 503, '{"error": {"message": "overloaded", "type": "ServiceUnavailableError"}}'),
        "not-json-error": ("status", 502, "<html>bad gateway</html>"),
        "malformed": stream((0.0, text_chunk("x")), (0.0, b"{not json"), done_at=0.0),
        "not-an-object": stream((0.0, b"[1, 2]"), done_at=0.0),
        "error-event": stream((0.0, text_chunk("x")), (0.0, {"error": {"message": "engine died"}}), done_at=0.0),
        "dropped": [*stream((0.0, text_chunk("x"))), (0.0, b"DROP")],
        "no-done": stream((0.0, text_chunk("x")), (0.0, usage_chunk(1, 1))),
        "empty": stream((0.0, usage_chunk(1, 0)), done_at=0.0),
        "too-slow": stream((2.0, text_chunk("x")), done_at=0.0),
        "no-usage": stream((0.0, text_chunk("x")), (0.01, text_chunk("y")), (0.01, text_chunk("z")), done_at=0.0),
    }
    names = list(scripts)
    result, _ = run(scripts, LoadSpec(concurrency=4, num_prompts=len(names)), singles(names), timeout=0.5)
    by_name = {names[r.session]: r for r in result.results}
    assert len(by_name) == len(names)  # every request recorded, the run finished
    expected = {
        "error-body": "http_503",
        "not-json-error": "http_502",
        "malformed": "malformed_chunk",
        "not-an-object": "malformed_chunk",
        "error-event": "server_error",
        "dropped": "connection",
        "no-done": "incomplete_stream",
        "empty": "no_content",
        "too-slow": "timeout",
    }
    assert {n: by_name[n].error for n in expected} == expected
    assert by_name["error-body"].error_detail == "overloaded"
    assert "bad gateway" in by_name["not-json-error"].error_detail
    assert by_name["ok"].ok and by_name["ok"].token_source == "usage"
    # without usage and without a tokenizer, tokens are counted as content chunks (and said so)
    assert by_name["no-usage"].ok and by_name["no-usage"].output_tokens == 3
    assert by_name["no-usage"].token_source == "chunks"
    s = summarize(result.results, result.duration)
    assert s["completed"] == 2 and s["failed"] == 9 and s["failures"]["malformed_chunk"] == 2


def test_tokenizer_fallback_counts_generated_text():
    scripts = {"*": stream((0.0, text_chunk("one two")), (0.0, text_chunk(" three")), done_at=0.0)}
    result, _ = run(
        scripts, LoadSpec(concurrency=1, num_prompts=1), singles(["a"]), count_tokens=lambda s: len(s.split())
    )
    (r,) = result.results
    assert r.output_tokens == 3 and r.token_source == "tokenizer"


def test_closed_loop_keeps_exactly_n_requests_in_flight():
    result, fake = run({"*": HELD}, LoadSpec(concurrency=4, num_prompts=16), singles(["r"] * 16))
    assert len(result.results) == 16 and all(r.ok for r in result.results)
    assert result.peak_concurrency == 4 and fake.peak == 4


def test_open_loop_cap_on_requests_in_flight():
    load = LoadSpec(request_rate=float("inf"), max_concurrency=3, num_prompts=12)
    result, fake = run({"*": HELD}, load, singles(["r"] * 12))
    assert len(result.results) == 12 and result.peak_concurrency == 3 and fake.peak == 3


def test_open_loop_all_at_once_without_cap():
    result, fake = run({"*": HELD}, LoadSpec(request_rate=float("inf"), num_prompts=10), singles(["r"] * 10))
    assert fake.peak == 10 and max(r.start for r in result.results) < 0.05


def test_open_loop_arrivals_follow_the_rate():
    result, _ = run({"*": QUICK}, LoadSpec(request_rate=50, num_prompts=30), singles(["r"] * 30), seed=3)
    starts = sorted(r.start for r in result.results)
    expected = np.cumsum([0.0, *[g for g, _ in zip(arrival_gaps(50, 1.0, np.random.default_rng(3)), range(29))]])
    assert np.allclose(starts, expected, atol=0.05)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_the_rate_and_burstiness(burstiness):
    gaps = np.array([g for g, _ in zip(arrival_gaps(8.0, burstiness, np.random.default_rng(0)), range(40000))])
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    # gamma: squared coefficient of variation = 1 / shape (1 for Poisson arrivals; burstier below 1)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.08)


def test_duration_stops_new_requests():
    sessions = (Session(i, ["r"], [4], [1]) for i in range(10**6))
    result, _ = run({"*": HELD}, LoadSpec(concurrency=2, num_prompts=None, duration=0.4), sessions)
    assert 4 <= len(result.results) <= 20
    assert max(r.start for r in result.results) < 0.4 and not result.interrupted


def test_stop_keeps_a_partial_result_and_marks_requests_in_flight():
    load = LoadSpec(concurrency=2, num_prompts=6)
    result, _ = run({"quick": QUICK, "slow": SLOW}, load, singles(["quick", "quick", "slow", "slow"]), stop_after=0.5)
    assert result.interrupted and result.duration < 3
    errors = sorted(str(r.error) for r in result.results)
    assert errors == ["None", "None", "interrupted", "interrupted"]


def test_multi_turn_sends_the_growing_history_with_the_replies():
    scripts = {"*": stream((0.0, text_chunk("reply")), done_at=0.0)}
    conv = Session(0, ["hi", "and then?", "bye"], [4, 4, 4], [1, 2, 1], system="be brief")
    _, fake = run(scripts, LoadSpec(concurrency=1, num_prompts=1), [conv], endpoint="chat")
    roles = [[m["role"] for m in b["messages"]] for b in fake.bodies]
    assert roles == [
        ["system", "user"],
        ["system", "user", "assistant", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"],
    ]
    assert fake.bodies[2]["messages"][2]["content"] == "reply"
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in fake.bodies)


def test_a_failed_turn_ends_its_conversation():
    scripts = {"hi": ("status", 400, '{"error": {"message": "bad"}}'), "*": QUICK}
    conv = Session(0, ["hi", "more"], [4, 4], [1, 1])
    result, fake = run(scripts, LoadSpec(concurrency=1, num_prompts=1), [conv], endpoint="chat")
    assert len(fake.bodies) == 1 and [r.error for r in result.results] == ["http_400"]


def test_chunks_of_shapes_no_server_sends_fail_the_request_not_the_run():
    big = b'{"choices": [{"index": 0, "text": "' + b"x" * 600_000 + b'"}]}'  # past aiohttp's line limit
    scripts = {
        "usage-string": stream((0.0, text_chunk("x")), (0.0, {"choices": [], "usage": "n/a"}), done_at=0.0),
        "choices-dict": stream((0.0, {"choices": {"text": "x"}}), done_at=0.0),
        "choice-none": stream((0.0, {"choices": [None]}), done_at=0.0),
        "delta-string": stream((0.0, {"choices": [{"delta": "x"}]}), done_at=0.0),
        "content-int": stream((0.0, {"choices": [{"delta": {"content": 5}}]}), done_at=0.0),
        "huge-line": stream((0.0, big), done_at=0.0),
        "error-null": stream((0.0, {"error": None, **text_chunk("x")}), done_at=0.0),
        "zero-usage": stream((0.0, text_chunk("x")), (0.0, text_chunk("y")), (0.0, usage_chunk(3, 0)), done_at=0.0),
        "ok": QUICK,
    }
    names = list(scripts)
    result, _ = run(scripts, LoadSpec(concurrency=3, num_prompts=len(names)), singles(names))
    by_name = {names[r.session]: r for r in result.results}
    assert len(by_name) == len(names)
    outcome = {n: by_name[n].error for n in names[:6]}
    assert outcome == {
        "usage-string": None,  # an unreadable usage is ignored: tokens are counted another way
        "choices-dict": "malformed_chunk",
        "choice-none": "malformed_chunk",
        "delta-string": "no_content",  # nothing readable came
        "content-int": "no_content",
        "huge-line": "client_error",
    }
    assert by_name["usage-string"].token_source == "chunks"
    # "error": null is no error, and a zero completion count with content streamed falls back to the chunks
    assert by_name["error-null"].ok and by_name["ok"].ok
    assert by_name["zero-usage"].ok and by_name["zero-usage"].output_tokens == 2
    assert by_name["zero-usage"].token_source == "chunks"


def test_reasoning_deltas_are_content():
    scripts = {
        "*": stream(
            (0.02, {"choices": [{"delta": {"role": "assistant"}}]}),
            (0.02, {"choices": [{"delta": {"reasoning": "hmm"}}]}),
            (0.02, {"choices": [{"delta": {"reasoning_content": "so"}}]}),
            (0.02, {"choices": [{"delta": {"content": "yes"}}]}),
            done_at=0.0,
        )
    }
    result, _ = run(scripts, LoadSpec(concurrency=1, num_prompts=1), singles(["q"]), endpoint="chat")
    (r,) = result.results
    assert r.ok and r.text == "hmmsoyes" and len(r.chunk_times) == 3
    assert r.ttft < r.chunk_times[-1]  # the first reasoning token is the first token


def test_sessions_are_drawn_before_the_clock_starts():
    import time as _time

    def slow_sessions():  # prompt text that takes 20 ms to make, as long tokenized prompts do
        for i in range(20):
            _time.sleep(0.02)
            yield Session(i, ["r"], [2], [1])

    result, _ = run({"*": QUICK}, LoadSpec(request_rate=100, num_prompts=20), slow_sessions(), seed=5)
    starts = sorted(r.start for r in result.results)
    expected = np.cumsum([0.0, *[g for g, _ in zip(arrival_gaps(100, 1.0, np.random.default_rng(5)), range(19))]])
    assert np.allclose(starts, expected, atol=0.015)  # the schedule holds; drawing 0.4 s of prompts did not shift it


def test_a_stop_while_sessions_are_drawn_ends_the_run_without_waiting_for_the_rest():
    import time as _time

    drawn = []

    def slow_sessions():  # 10,000 prompts of 10 ms each: 100 s to draw them all
        for i in range(10_000):
            _time.sleep(0.01)
            drawn.append(i)
            yield Session(i, ["r"], [2], [1])

    t0 = _time.monotonic()
    result, fake = run({"*": QUICK}, LoadSpec(concurrency=2, num_prompts=10_000), slow_sessions(), stop_after=0.3)
    # the stop lands between two chunks of the draw: the run ends, nothing was sent, and the draw went no further
    assert _time.monotonic() - t0 < 5
    assert result.interrupted and result.results == [] and fake.bodies == []
    assert len(drawn) < 300


def test_open_loop_duration_stops_and_an_endless_infinite_rate_is_refused():
    sessions = (Session(i, ["r"], [4], [1]) for i in range(10**6))
    result, _ = run({"*": QUICK}, LoadSpec(request_rate=40, num_prompts=None, duration=0.3), sessions)
    assert 3 <= len(result.results) <= 40 and max(r.start for r in result.results) < 0.3
    with pytest.raises(ValueError, match="infinite request rate needs --num-prompts"):
        LoadSpec(request_rate=float("inf"), num_prompts=None, duration=1)
    for bad in (dict(num_prompts=-1), dict(num_prompts=0), dict(max_concurrency=0), dict(duration=0)):
        with pytest.raises(ValueError):
            LoadSpec(request_rate=5, **bad)


def test_stop_during_warmup_ends_the_run_at_once():
    load = LoadSpec(concurrency=1, num_prompts=3, warmup=1)
    result, fake = run({"*": SLOW}, load, singles(["slow"] * 4), stop_after=0.3)
    assert result.interrupted and result.results == [] and len(fake.bodies) == 1


def test_one_token_requests_have_no_tpot_but_count_for_goodput():
    from fulcrum.bench.metrics import parse_slo

    scripts = {"one": stream((0.0, text_chunk("x")), (0.0, usage_chunk(1, 1)), done_at=0.0), "two": QUICK}
    result, _ = run(scripts, LoadSpec(concurrency=1, num_prompts=2), singles(["one", "two"]))
    one = next(r for r in result.results if r.session == 0)
    assert one.ok and one.tpot is None
    s = summarize(result.results, result.duration, slo=parse_slo("tpot=1s"))
    assert s["completed"] == 2 and s["slo_attainment"] == 1.0
    assert s["tpot_ms"]["mean"] == pytest.approx(next(r for r in result.results if r.session == 1).tpot * 1e3)


def test_plots_of_a_sweep_with_a_point_where_nothing_completed(tmp_path):
    from fulcrum.bench.report import write_plots

    ok, _ = run({"*": QUICK}, LoadSpec(concurrency=1, num_prompts=2), singles(["r", "r"]))
    bad, _ = run({"*": ("status", 503, "{}")}, LoadSpec(concurrency=1, num_prompts=2), singles(["r", "r"]))
    runs = []
    for label, res in (("concurrency 1", ok), ("concurrency 2", bad)):
        summary = summarize(res.results, res.duration)
        requests = [{"ok": r.ok, "ttft": r.ttft, "chunk_times": r.chunk_times} for r in res.results]
        runs.append({"label": label, "summary": summary, "requests": requests})
    assert len(write_plots(tmp_path, runs)) == 3


async def never_answers(request, body):  # takes the request, sends not even headers
    await until_gone(request)


def test_a_silent_server_fails_at_the_read_deadline_and_the_run_goes_on():
    scripts = {"stalls-mid-stream": [*stream((0.0, text_chunk("x"))), STALL], "never-answers": never_answers}
    scripts["ok"] = QUICK
    names = ["stalls-mid-stream", "never-answers", "ok"]
    load = LoadSpec(concurrency=1, num_prompts=3)
    result, fake = run(scripts, load, singles(names), timeout=60, read_timeout=0.3)
    by_name = {names[r.session]: r for r in result.results}
    for name in names[:2]:
        assert by_name[name].error == "timeout"
        assert by_name[name].error_detail == "timed out: no data for 0.3 s (the stream went silent)"
    assert by_name["stalls-mid-stream"].ttft is not None  # it had started: cut mid-stream
    assert by_name["ok"].ok and not result.interrupted
    assert result.duration < 60  # ended by the read deadline, not the whole request's


def test_a_trickling_stream_fails_at_the_request_deadline():
    trickle = stream(*[(0.05, text_chunk("x"))] * 200)  # never silent for long, never done
    result, _ = run({"*": trickle}, LoadSpec(concurrency=1, num_prompts=1), singles(["t"]), timeout=0.5, read_timeout=5)
    (r,) = result.results
    assert r.error == "timeout" and r.error_detail == "timed out after 0.5 s without a complete answer"
    assert len(r.chunk_times) >= 1


def test_a_server_that_takes_no_connection_fails_at_the_request_deadline():
    import socket

    from fulcrum.bench.client import RequestResult, send

    async def main(port):
        async with aiohttp.ClientSession() as http:
            r = RequestResult(session=0, turn=0)
            return await send(http, Target(f"http://127.0.0.1:{port}", "m"), {}, r, timeout=0.5, read_timeout=30)

    with socket.socket() as full:  # a listener whose queue is full: the kernel drops further connection attempts
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        waiting = [socket.socket() for _ in range(3)]
        for c in waiting:
            c.setblocking(False)
            c.connect_ex(full.getsockname())
        try:
            r = asyncio.run(main(full.getsockname()[1]))
        finally:
            for c in waiting:
                c.close()
    assert r.error == "timeout" and r.error_detail == "timed out after 0.5 s without a complete answer"


def test_a_chunk_that_breaks_the_json_parser_fails_only_its_request():
    deep = b"[" * 5000  # json.loads raises RecursionError, which is no ValueError
    names = ["deep", "ok"]
    result, _ = run({"deep": stream((0.0, deep), done_at=0.0), "ok": QUICK}, LoadSpec(concurrency=1, num_prompts=2),
                    singles(names))  # fmt: skip
    by_name = {names[r.session]: r for r in result.results}
    assert by_name["deep"].error == "client_error" and "RecursionError" in by_name["deep"].error_detail
    assert by_name["ok"].ok


def test_a_cancelled_run_keeps_what_it_measured_and_leaves_nothing_running():
    async def main():
        fake = FakeServer({"quick": QUICK, "slow": SLOW})
        async with serving(fake) as url, aiohttp.ClientSession() as http:
            gen = LoadGenerator(http, Target(url, "fake-model"))
            load = LoadSpec(concurrency=2, num_prompts=4)
            names = ["quick", "quick", "slow", "slow"]
            task = asyncio.ensure_future(gen.run(load, singles(names), asyncio.Event()))
            while len(fake.bodies) < 4:  # both slow ones are out
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):  # the server sees the connections go
                if fake.inflight == 0:
                    break
                await asyncio.sleep(0.01)
            return gen.partial(), fake.inflight, len(fake.bodies)

    partial, inflight, sent = asyncio.run(main())
    assert partial.interrupted
    assert sorted(str(r.error) for r in partial.results) == ["None", "None", "interrupted", "interrupted"]
    assert inflight == 0 and sent == 4  # no request went on, or was sent, after the cancel


def test_a_cancel_that_comes_while_a_stopped_run_winds_down_is_not_swallowed():
    # Ctrl-C under asyncio.run cancels the main task; if that lands while until_stop waits for its stopped work
    # to finish, the cancel must still end the caller (a tune walked on through candidates when it was lost)
    from fulcrum.bench.loadgen import until_stop

    async def work():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # a slow wind-down: requests in flight being recorded
            raise

    async def caller(stop):
        stopped = await until_stop(work(), stop)
        return "went on" if stopped else "finished"

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(caller(stop))
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.sleep(0.05)  # until_stop is now waiting for the work's wind-down
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(main())
