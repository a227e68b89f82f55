"""`fulcrum serve --kv-offload-dir`: a server restarted on the same directory answers a repeated long prompt from
disk (usage.prompt_tokens_details.cached_tokens, the same tokens), two replicas sharing a directory take each other's
prefills as hits, and /metrics shows the tiers."""

from __future__ import annotations

import time

import httpx

from tests.server.test_http_errors import metric

# a long prompt of the bundled model's token ids (its vocabulary is 65 characters)
PROMPT = [(13 * k + 7) % 60 + 2 for k in range(1000)]
BODY = {"model": "shakespeare", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}


def complete(server) -> tuple[list[str], int]:
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_restart_on_the_same_directory_starts_warm(fresh_server, tmp_path):
    kv_dir = str(tmp_path / "kv")
    first = fresh_server("--kv-offload-dir", kv_dir)
    cold_text, cold_cached = complete(first)
    assert cold_cached == 0
    first.stop()
    second = fresh_server("--kv-offload-dir", kv_dir)
    with open(second.log_path) as log:
        assert "the disk tier starts warm with" in log.read()
    text, cached = complete(second)
    assert text == cold_text and cached == (len(PROMPT) - 1) // 16 * 16
    assert metric(second, 'fulcrum:kv_offload_hit_tokens_total{model_name="shakespeare",tier="disk"}') == cached
    assert metric(second, "fulcrum:prefix_cache_hits_total") == cached
    text = httpx.get(f"{second.url}/metrics").text
    for series in ("fulcrum:kv_offload_load_seconds_bucket", "fulcrum:kv_offload_used_bytes",
                   "fulcrum:kv_offload_capacity_bytes", "fulcrum:kv_offload_stored_blocks_total"):  # fmt: skip
        assert series in text, series


def test_replicas_sharing_a_directory_take_each_others_prefills(fresh_server, tmp_path):
    kv_dir = str(tmp_path / "kv")
    a = fresh_server("--kv-offload-dir", kv_dir, "--kv-offloading-size", "0.1")
    b = fresh_server("--kv-offload-dir", kv_dir, "--kv-offloading-size", "0.1")
    text_a, cached_a = complete(a)
    assert cached_a == 0
    # a's blocks reach the directory on its next idle tick: b then finds them there
    deadline = 50
    while metric(a, 'fulcrum:kv_offload_stored_blocks_total{model_name="shakespeare",tier="disk"}') < len(PROMPT) // 16:
        deadline -= 1
        assert deadline, "replica a never wrote its blocks"
        time.sleep(0.1)
    text_b, cached_b = complete(b)
    assert text_b == text_a and cached_b == (len(PROMPT) - 1) // 16 * 16
