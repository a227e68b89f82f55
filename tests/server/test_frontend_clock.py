"""The server's clocks start when a request arrives over HTTP, as the user feels it: a client that sends its body
slowly sees that time in the server's TTFT, end-to-end latency and the frontend's receive stage; every stage of a
request is counted once in fulcrum:frontend_stage_seconds."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.server.stages import WakeStampingLoop, bytes_found_at

PAUSE = 0.6  # seconds between the headers and the body's last half


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def value(got: dict, name: str, **labels) -> float:
    return next(v for (n, ls), v in got.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def slow_post(url: str, path: str, body: dict) -> dict:
    """POST with the body's second half sent PAUSE seconds after the headers and first half."""
    u = urlparse(url)
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(head + raw[: len(raw) // 2])
        time.sleep(PAUSE)
        s.sendall(raw[len(raw) // 2 :])
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    assert status == 200, reply[:300]
    return json.loads(reply.partition(b"\r\n\r\n")[2])


def test_clocks_start_at_http_arrival(fresh_server):
    s = fresh_server()
    out = slow_post(s.url, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "ROMEO:"}], "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert out["choices"][0]["message"]["content"]
    got = samples(s.url)
    assert value(got, "fulcrum:time_to_first_token_seconds_count") == 1
    assert value(got, "fulcrum:time_to_first_token_seconds_sum") >= PAUSE
    assert value(got, "fulcrum:e2e_request_latency_seconds_sum") >= PAUSE
    assert value(got, "fulcrum:request_queue_time_seconds_sum") >= PAUSE  # waiting for the engine, as felt
    assert value(got, "fulcrum:frontend_stage_seconds_sum", stage="receive") >= PAUSE
    for stage in ("receive", "tokenize", "params"):
        assert value(got, "fulcrum:frontend_stage_seconds_count", stage=stage) == 1
    # a fast client: the stages are small and, with the engine's part, make up the TTFT
    httpx.post(f"{s.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=60).raise_for_status()
    after = samples(s.url)
    for stage in ("receive", "tokenize", "params"):
        assert value(after, "fulcrum:frontend_stage_seconds_count", stage=stage) == 2
    frontend = sum(value(after, "fulcrum:frontend_stage_seconds_sum", stage=st) -
                   value(got, "fulcrum:frontend_stage_seconds_sum", stage=st) for st in ("receive", "tokenize", "params"))  # fmt: skip
    ttft = value(after, "fulcrum:time_to_first_token_seconds_sum") - value(
        got, "fulcrum:time_to_first_token_seconds_sum"
    )
    assert 0 < frontend < ttft < PAUSE


def test_arrival_is_when_the_request_s_first_bytes_are_read(fresh_server):
    # half the request line and headers, a pause, then the rest: the clocks start at the first bytes, not when the
    # headers are complete and the app is started on them
    s = fresh_server()
    u = urlparse(s.url)
    raw = json.dumps({"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((u.hostname, u.port), timeout=60) as c:
        c.sendall(head[:20])
        time.sleep(PAUSE)
        c.sendall(head[20:] + raw)
        reply = b""
        while chunk := c.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    got = samples(s.url)
    assert value(got, "fulcrum:time_to_first_token_seconds_sum") >= PAUSE
    assert value(got, "fulcrum:frontend_stage_seconds_sum", stage="receive") >= PAUSE


def test_a_streamed_answer_s_first_tokens_are_timed_once_each_when_written(fresh_server):
    # streamed: TTFT ends when the chunk with each prompt's first token is written (one observation per sample);
    # whole: when the tokens reach the frontend; the same counts either way
    s = fresh_server()
    body = {"prompt": ["ROMEO:", "JULIET:"], "n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 1}
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 4
    got = samples(s.url)
    assert value(got, "fulcrum:time_to_first_token_seconds_count") == 4
    httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).raise_for_status()
    assert value(samples(s.url), "fulcrum:time_to_first_token_seconds_count") == 8
    # a stream of one token (its first token and its end in one engine message), through the chat route
    chat = {"messages": [{"role": "user", "content": "ROMEO:"}], "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=chat, timeout=60) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    after = samples(s.url)
    assert value(after, "fulcrum:time_to_first_token_seconds_count") == 9
    assert value(after, "fulcrum:time_to_first_token_seconds_sum") > value(
        got, "fulcrum:time_to_first_token_seconds_sum"
    )


def test_a_request_arrives_when_the_loop_finds_its_bytes_not_when_it_gets_round_to_reading_them():
    # the server's loop (WakeStampingLoop) with a callback ahead of a socket's read in every pass (50 ms each, as a
    # frontend busy streaming other requests' tokens): the bytes are stamped when the loop's wait found them, before
    # that callback, and never before they were sent
    loop = WakeStampingLoop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    read = loop.create_future()
    sent = {}

    def busy():
        time.sleep(0.05)
        if not read.done():
            loop.call_soon(busy)

    def readable():
        ours.recv(16)
        loop.remove_reader(ours)
        read.set_result((bytes_found_at(loop), time.time()))

    def send():
        time.sleep(0.12)
        sent["at"] = time.time()
        theirs.send(b"GET")

    loop.add_reader(ours, readable)
    loop.call_soon(busy)
    sender = threading.Thread(target=send)
    sender.start()
    try:
        found, now = loop.run_until_complete(asyncio.wait_for(read, 10))
    finally:
        sender.join()
        loop.close()
        ours.close()
        theirs.close()
    assert sent["at"] <= found
    assert now - found >= 0.045  # the busy callback ran between the two
