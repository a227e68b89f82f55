"""A server started with a quantized KV cache says so on its startup line and in /metrics, with its capacity."""

import httpx

from tests.server.test_http_errors import metric


def test_startup_line_and_metrics_show_the_quantized_cache(server, fresh_server):
    s = fresh_server("--kv-cache-dtype", "int8")
    quantized, full = metric(s, "fulcrum:kv_cache_capacity_tokens"), metric(server, "fulcrum:kv_cache_capacity_tokens")
    # the bundled model is fp32: 128 bytes a head against 32 + a 2-byte scale
    assert 3.6 < quantized / full <= 4, (quantized, full)
    text = httpx.get(f"{s.url}/metrics").text
    assert 'cache_dtype="int8 with a scale per token and head"' in text
    with open(s.log_path) as log:
        assert "(int8 with a scale per token and head)" in log.read()
    r = httpx.post(f"{s.url}/v1/completions", json={"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
