"""Every error case over raw HTTP, in OpenAI's error shape; the engine survives all of them."""

import os
import signal
import threading
import time

import httpx
import pytest


def post(server, path, body=None, content=None, headers=None):
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=60)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert param in (err["param"] or "")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 5000}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "word " * 1100, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "role"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, None),
        (  # past --max-grammar-bytes (issue 37: such schemas kept the grammar workers busy for minutes)
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "huge",
                        "schema": {
                            "type": "object",
                            "properties": {f"p{i}": {"type": "string"} for i in range(20_000)},
                        },
                    },
                },
            },
            "response_format",
        ),
    ],
)
def test_invalid_values_are_400(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_malformed_json_is_400(server):
    assert_error(
        post(server, "/v1/completions", content=b'{"prompt": "Hi",', headers={"content-type": "application/json"}), 400
    )


def test_unknown_model_is_404(server):
    assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "Hi"}), 404, "model")


def test_engine_still_serves_after_bad_requests(server):
    r = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_tokenize_detokenize_health_version(server):
    ids = post(server, "/tokenize", {"prompt": "To be"}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "To be"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def metric(server, name):
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name if "{" in name else (name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def running(server, n: int, timeout: float = 30) -> None:
    """Wait until the server's engine runs at least `n` requests."""
    deadline = time.time() + timeout
    while True:
        try:
            if metric(server, "fulcrum:num_requests_running") >= n:
                return
        except KeyError:  # the gauge appears with the core's first report
            pass
        assert time.time() < deadline, f"fewer than {n} requests running after {timeout} s"
        time.sleep(0.02)


def test_mid_stream_disconnect_frees_kv_blocks(server):
    body = {"prompt": "ROMEO:", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data:") for x in got)
        assert metric(server, "fulcrum:kv_cache_usage_perc") > 0 or metric(server, "fulcrum:num_requests_running") > 0
    deadline = time.time() + 10
    while time.time() < deadline:
        if metric(server, "fulcrum:kv_cache_usage_perc") == 0 and metric(server, "fulcrum:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(server, "fulcrum:kv_cache_usage_perc") == 0
    assert metric(server, 'fulcrum:request_success_total{finished_reason="abort"') >= 1


def test_metrics_have_vllm_names_when_asked(fresh_server):
    s = fresh_server("--metrics-compat", "vllm")
    post(s, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3})
    text = httpx.get(f"{s.url}/metrics").text
    for name in [
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:prefix_cache_queries_total",
        "vllm:request_success_total",
        "fulcrum:num_preemptions_total",
    ]:
        assert name in text, name


def test_one_model_by_id_and_unknown_ids_404(server):
    r = httpx.get(f"{server.url}/v1/models/shakespeare")
    assert r.status_code == 200 and r.json()["id"] == "shakespeare" and r.json()["object"] == "model"
    assert_error(httpx.get(f"{server.url}/v1/models/gpt-9"), 404, "model")
    assert_error(httpx.get(f"{server.url}/v1/models/org/gpt-9"), 404, "model")


def test_a_developer_turn_is_a_system_turn(server):
    """OpenAI's newer name for the system message: accepted, and answered exactly as the system turn is."""
    turns = [{"role": "developer", "content": "Speak as a king."}, {"role": "user", "content": "What news?"}]
    body = {"messages": turns, "max_tokens": 12, "temperature": 0}
    dev = post(server, "/v1/chat/completions", body)
    assert dev.status_code == 200, dev.text
    turns[0]["role"] = "system"
    assert (
        dev.json()["choices"][0]["message"]
        == post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    )


def test_no_cors_headers_unless_origins_are_allowed(server):
    r = httpx.options(
        f"{server.url}/v1/completions",
        headers={"Origin": "http://app.test", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers


def test_api_key_is_required(fresh_server):
    s = fresh_server("--api-key", "sesame", "--allowed-origins", "http://app.test")
    assert_error(post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}), 401)
    assert_error(post(s, "/v1/completions", {"prompt": "Hi"}, headers={"Authorization": "Bearer nope"}), 401)
    ok = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200
    assert httpx.get(f"{s.url}/health").status_code == 200 and httpx.get(f"{s.url}/metrics").status_code == 200
    assert_error(httpx.get(f"{s.url}/v1/models/shakespeare"), 401)
    # --allowed-origins: a browser's preflight (which carries no key) is answered for that origin only
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    pre = httpx.options(f"{s.url}/v1/completions", headers={"Origin": "http://app.test", **ask})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.test"
    other = httpx.options(f"{s.url}/v1/completions", headers={"Origin": "http://evil.test", **ask})
    assert "access-control-allow-origin" not in other.headers
    r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": "Bearer sesame",
                                                                               "Origin": "http://app.test"})  # fmt: skip
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.test"


def test_full_waiting_queue_is_503_with_retry_after(fresh_server):
    s = fresh_server("--max-num-seqs", "1", "--max-waiting-requests", "2")
    results = []

    def fire():
        results.append(post(s, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True}))

    threads = [threading.Thread(target=fire) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert 503 in codes and 200 in codes, codes
    rejected = next(r for r in results if r.status_code == 503)
    assert rejected.headers["retry-after"]
    assert_error(rejected, 503)


def test_engine_death_fails_requests_and_exits_nonzero(fresh_server):
    s = fresh_server()
    results = []
    t = threading.Thread(
        target=lambda: results.append(
            post(s, "/v1/completions", {"prompt": "A", "max_tokens": 900, "ignore_eos": True})
        )
    )
    t.start()
    running(s, 1)  # the request is in the engine: killed now, not after it ends (900 tokens take ~1 s on a fast CPU)
    os.kill(s.engine_pid(), signal.SIGKILL)
    t.join(30)
    assert results and results[0].status_code >= 500
    assert s.proc.wait(30) != 0


def test_sigterm_drains_in_flight_then_exits_zero(fresh_server):
    s = fresh_server()
    results = []
    t = threading.Thread(
        target=lambda: results.append(post(s, "/v1/completions", {"prompt": "A", "max_tokens": 60, "ignore_eos": True}))
    )
    t.start()
    time.sleep(0.5)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert results and results[0].status_code == 200
    assert results[0].json()["usage"]["completion_tokens"] == 60
    assert s.proc.wait(30) == 0


def test_engine_core_exits_when_the_frontend_is_killed(fresh_server):
    s = fresh_server()
    engine = s.engine_pid()
    s.proc.kill()
    s.proc.wait(10)
    deadline = time.time() + 20
    while time.time() < deadline and os.path.exists(f"/proc/{engine}"):
        with open(f"/proc/{engine}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # exited, waiting to be reaped
                break
        time.sleep(0.2)
    alive = os.path.exists(f"/proc/{engine}")
    if alive:
        with open(f"/proc/{engine}/stat") as f:
            alive = f.read().split(")")[-1].split()[0] != "Z"
    assert not alive, "the engine core outlived its frontend"
