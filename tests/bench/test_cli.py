"""`fulcrum bench serve` against a scripted server that stalls: every request ends by its deadline, the
watchdog says what the run waits for, and however the run ends, `--out` holds what it measured."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fulcrum.bench import loadgen
from fulcrum.cli import main
from tests.bench.fake_server import STALL, FakeServer, serving_in_thread, stream, text_chunk, until_gone

QUICK = stream((0.0, text_chunk("x")), (0.0, text_chunk("y")), done_at=0.0)
LOAD = ["--quiet", "--model", "fake-model", "--input-len", "4", "--output-len", "2"]


def quick_then_stall(quick: int):
    """The first `quick` requests are answered; every later one gets a token, then silence."""
    served = 0

    async def script(request, body):
        nonlocal served
        served += 1
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _, line in QUICK if served <= quick else stream((0.0, text_chunk("x"))):
            await resp.write(line)
        if served > quick:
            await until_gone(request)
        return resp

    return script


def test_a_stalled_stream_times_out_the_watchdog_says_so_and_out_is_written(tmp_path, capsys):
    out = tmp_path / "result.json"
    fake = FakeServer({"*": [*stream((0.0, text_chunk("x"))), STALL]})
    with serving_in_thread(fake) as url:
        args = ["bench", "serve", "--base-url", url, *LOAD, "--concurrency", "1", "--num-prompts", "2"]
        args += ["--read-timeout", "1", "--request-timeout", "30", "--watchdog", "0.2", "--out", str(out)]
        assert main(args) == 0
    err = capsys.readouterr().err
    assert "waiting: concurrency 1: 0 of 2 requests done, none completed for" in err
    assert "1 in flight, the oldest for" in err and "(cut at: deadline 30 s, 1 s of silence)" in err
    doc = json.loads(out.read_text())
    assert doc["partial"] is False and doc["stopped_by"] is None and doc["read_timeout_s"] == 1
    (run,) = doc["runs"]
    assert run["summary"]["failures"] == {"timeout": 2} and not run["interrupted"]
    assert {q["error_detail"] for q in run["requests"]} == {"timed out: no data for 1 s (the stream went silent)"}


def test_a_keyboard_interrupt_mid_run_leaves_a_partial_out(tmp_path, monkeypatch):
    real_send, sent = loadgen.send, []

    async def send(*a, **kw):  # the third request is where the user's Ctrl-C lands
        sent.append(1)
        if len(sent) == 3:
            raise KeyboardInterrupt
        return await real_send(*a, **kw)

    monkeypatch.setattr(loadgen, "send", send)
    out = tmp_path / "partial.json"
    fake = FakeServer({"*": QUICK})
    with serving_in_thread(fake) as url:
        args = ["bench", "serve", "--base-url", url, *LOAD, "--concurrency", "1,4", "--num-prompts", "5"]
        assert main([*args, "--out", str(out)]) == 130
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["stopped_by"] == "cancelled"
    (run,) = doc["runs"]
    assert run["interrupted"] and run["label"] == "concurrency 1"
    assert [q["error"] for q in run["requests"]] == [None, None, "interrupted"]  # what completed, kept


def test_sigterm_mid_run_leaves_a_partial_out(tmp_path):
    out = tmp_path / "partial.json"
    fake = FakeServer({"*": quick_then_stall(2)})
    with serving_in_thread(fake) as url:
        cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", url, *LOAD]
        cmd += ["--concurrency", "1", "--num-prompts", "50", "--out", str(out)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
        try:
            deadline = time.monotonic() + 60
            while len(fake.bodies) < 3 and time.monotonic() < deadline:  # the third one is stalled
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr.decode()
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["stopped_by"] == "SIGTERM"
    (run,) = doc["runs"]
    assert run["interrupted"]
    assert [q["error"] for q in run["requests"]] == [None, None, "interrupted"]


BAD_SECONDS = [
    (flag, value)
    for flag in ("--request-timeout", "--read-timeout", "--watchdog")
    for value in ("0", "-1", "nan", "inf")
    if (flag, value) != ("--watchdog", "0")  # which turns the watchdog off
]


@pytest.mark.parametrize(("flag", "value"), BAD_SECONDS)
def test_timeouts_must_be_positive_seconds(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", flag, value])
    assert e.value.code == 2 and "seconds > 0" in capsys.readouterr().err
