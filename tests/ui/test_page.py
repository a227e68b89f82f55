"""The web page at / in headless Chromium against a real `fulcrum serve`: it loads with no console error under its
Content-Security-Policy, streams a chat answer token by token with its TTFT, stops a request (the server's running
count back to 0), shows on its dashboard the numbers /metrics gives at the same moment, draws a bench result's
charts (served, and offline from `fulcrum bench view`), and works behind --api-key."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import start_server
from tests.ui.browser import console_errors, missing

if why := missing():
    pytest.skip(f"no headless browser: {why}", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402


def wait_for(condition, timeout=20.0, every=0.05, what="the condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def js(d, script, *args):
    return d.execute_script(script, *args)


def metrics(url: str) -> dict[str, list]:
    """/metrics by prometheus_client's own parser: name -> [(sample name, labels, value)]."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        out[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return out


def total(m: dict, sample: str) -> float:
    return sum(v for fam in m.values() for name, _, v in fam if name == sample)


def buckets(m: dict, histogram: str) -> list[tuple[float, float]]:
    acc: dict[float, float] = {}
    for name, labels, v in m.get(histogram, []):
        if name == histogram + "_bucket":
            acc[float(labels["le"])] = acc.get(float(labels["le"]), 0) + v
    return sorted(acc.items())


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus' definition: linear inside the bucket the rank falls in."""
    rank = q * cumulative[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for i, (le, count) in enumerate(cumulative):
        if count >= rank:
            if math.isinf(le):
                return cumulative[i - 1][0]
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return cumulative[-1][0]


def open_page(d, url: str, tab: str = "chat"):
    d.get("about:blank")  # a fresh page: the same URL again would only move to its #fragment
    console_errors(d)  # what an earlier page logged is not this one's
    d.get(f"{url}/#{tab}")
    wait_for(lambda: js(d, "return document.getElementById('model').options.length > 0"), what="the model list")


def set_fields(d, **values):
    for k, v in values.items():
        js(d, "document.getElementById(arguments[0]).value = arguments[1]", k, str(v))


def answer(d) -> dict:
    return js(
        d,
        """const a = document.querySelector('.turn:last-child .answer');
        return a ? {text: a.querySelector('.text').textContent, ttft: a.dataset.ttftMs, tokens: a.dataset.tokens,
                    finish: a.dataset.finish, done: a.closest('.turn').classList.contains('done')} : null""",
    )


def send(d, prompt: str):
    d.find_element(By.ID, "prompt").send_keys(prompt)
    d.find_element(By.ID, "send").click()


def test_the_page_loads_with_its_policy_and_no_console_error(server, browser):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    js_file = httpx.get(server.url + "/ui/app.js")
    assert js_file.status_code == 200 and js_file.headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url + "/ui/nothing.js").status_code == 404
    console_errors(browser)
    open_page(browser, server.url)
    for tab in ("dashboard", "bench", "chat"):
        browser.find_element(By.CSS_SELECTOR, f"[data-tab={tab}]").click()
    wait_for(lambda: int(js(browser, "return document.getElementById('poll-state').dataset.polls")) >= 1)
    assert console_errors(browser) == []
    assert js(browser, "return document.getElementById('model').value") == "shakespeare"


def test_a_chat_answer_streams_token_by_token_with_its_ttft(server, browser):
    open_page(browser, server.url)
    set_fields(browser, max_tokens=400, temperature=0.8, extra='{"ignore_eos": true}')
    send(browser, "Good morrow, my lord")
    lengths = []
    while not (a := answer(browser)) or not a["done"]:
        lengths.append(len(a["text"]) if a else 0)
        time.sleep(0.02)
    grew = [x for x, y in zip(lengths, lengths[1:]) if y > x]
    assert len(grew) >= 5, f"the answer did not grow over several polls: {lengths}"
    assert float(a["ttft"]) > 0 and a["tokens"] == "400" and a["finish"] == "length"
    stats = js(browser, "return document.querySelector('.turn:last-child .stats').textContent")
    assert "TTFT" in stats and "TPOT" in stats and "400 tokens" in stats
    assert console_errors(browser) == []


def test_stop_aborts_the_request_and_the_server_runs_nothing(server, browser):
    open_page(browser, server.url)
    before = total(metrics(server.url), "fulcrum:generation_tokens_total")
    set_fields(browser, max_tokens=1000, extra='{"ignore_eos": true}')
    send(browser, "Speak on")
    wait_for(lambda: (a := answer(browser)) and len(a["text"]) > 20, what="the first tokens")
    assert total(metrics(server.url), "fulcrum:num_requests_running") == 1
    browser.find_element(By.ID, "stop-btn").click()
    wait_for(lambda: total(metrics(server.url), "fulcrum:num_requests_running") == 0, timeout=10,
             what="the server's running count back to 0")  # fmt: skip
    a = wait_for(lambda: (a := answer(browser)) and a["done"] and a, what="the answer to close")
    assert a["finish"] == "stopped"
    generated = total(metrics(server.url), "fulcrum:generation_tokens_total") - before
    assert generated < 1000, "the request ran to its end: stop did not abort it"


def test_the_dashboard_shows_what_metrics_says(server, browser):
    open_page(browser, server.url, "dashboard")
    set_fields(browser, **{"poll-interval": 1000})
    js(browser, "document.getElementById('poll-interval').dispatchEvent(new Event('change'))")

    def polls():
        return int(js(browser, "return document.getElementById('poll-state').dataset.polls"))

    wait_for(lambda: polls() >= 1, what="the first poll")
    base = metrics(server.url)  # no traffic since the page's first poll: its window starts here
    for i in range(3):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "ROMEO:" * (i + 1), "max_tokens": 16 * (i + 1), "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200
    seen = polls()
    wait_for(lambda: polls() >= seen + 2, what="two polls after the requests")
    now = metrics(server.url)
    shown = js(browser, "return Object.fromEntries([...document.querySelectorAll('[data-value]')]"
                        ".map(e => [e.id, e.dataset.value]))")  # fmt: skip
    want = {
        "m-running": total(now, "fulcrum:num_requests_running"),
        "m-waiting": total(now, "fulcrum:num_requests_waiting"),
        "m-kv-usage": total(now, "fulcrum:kv_cache_usage_perc"),
        "m-kv-capacity": total(now, "fulcrum:kv_cache_capacity_tokens"),
        "m-in-total": total(now, "fulcrum:prompt_tokens_total"),
        "m-out-total": total(now, "fulcrum:generation_tokens_total"),
        "m-preemptions": total(now, "fulcrum:num_preemptions_total"),
        "m-in-rate": 0.0,  # idle between the last two polls
        "m-out-rate": 0.0,
    }
    for key, value in want.items():
        assert float(shown[key]) == pytest.approx(value), key
    hits, queries = total(now, "fulcrum:prefix_cache_hits_total"), total(now, "fulcrum:prefix_cache_queries_total")
    assert float(shown["m-prefix-hit"]) == pytest.approx(hits / queries)
    # percentiles over the window: the bucket deltas since the page's first poll, as Prometheus computes them
    for key, hist in (("ttft", "fulcrum:time_to_first_token_seconds"), ("itl", "fulcrum:inter_token_latency_seconds"),
                      ("e2e", "fulcrum:e2e_request_latency_seconds")):  # fmt: skip
        delta = [(le, c - dict(buckets(base, hist)).get(le, 0)) for le, c in buckets(now, hist)]
        assert float(shown[f"l-{key}-count"]) == delta[-1][1] and delta[-1][1] > 0, key
        for q in (0.5, 0.9, 0.99):
            assert float(shown[f"l-{key}-p{round(q * 100)}"]) == pytest.approx(histogram_quantile(q, delta)), key
    assert console_errors(browser) == []


def bench_result(server, tmp_path) -> str:
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", server.url, "--concurrency", "1,2",
           "--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--slo", "ttft=2s",
           "--price-per-hour", "2", "--out", str(out), "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return str(out)


def drawn(d, canvas_id: str) -> int:
    """Coloured pixels on a canvas: bars, lines and dots (axes, labels and an empty chart's message are grey)."""
    return js(
        d,
        """const c = document.getElementById(arguments[0]);
        const p = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < p.length; i += 4) if (p[i+3] > 200 && Math.max(p[i], p[i+1], p[i+2]) - Math.min(p[i], p[i+1], p[i+2]) > 80) n++;
        return n""",
        canvas_id,
    )


CHARTS = ("b-latency", "b-latency-token", "b-curve", "b-goodput", "b-cost")


def test_a_bench_result_renders_its_charts_served_and_offline(server, browser, tmp_path):
    result = bench_result(server, tmp_path)
    open_page(browser, server.url, "bench")
    browser.find_element(By.ID, "bench-files").send_keys(result)
    wait_for(lambda: js(browser, "return document.querySelectorAll('#bench-table tbody tr').length") == 2)
    for canvas in CHARTS:
        assert drawn(browser, canvas) > 100, canvas
    assert console_errors(browser) == []

    page = tmp_path / "view.html"
    cli = [sys.executable, "-m", "fulcrum.cli", "bench", "view", result, result, "--out", str(page), "--no-open"]
    subprocess.run(cli, check=True, capture_output=True, timeout=60)
    browser.get(page.as_uri())
    wait_for(lambda: js(browser, "return document.querySelectorAll('#bench-table tbody tr').length") == 4)
    for canvas in CHARTS:
        assert drawn(browser, canvas) > 100, canvas
    assert console_errors(browser) == []  # the inlined script and style pass the page's own policy


def test_the_page_works_behind_the_api_key(browser, tmp_path):
    s = start_server(tmp_path, "--api-key", "sesame")
    try:
        assert httpx.get(s.url + "/").status_code == 200  # the page itself needs no key
        assert httpx.get(s.url + "/ui/app.js").status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401  # the API still does
        assert httpx.get(s.url + "/metrics").status_code == 200  # open, as before the page
        browser.get(s.url + "/")
        wait_for(lambda: js(browser, "return !document.getElementById('key-form').hidden"), what="the key form")
        browser.find_element(By.ID, "api-key").send_keys("sesame")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(lambda: js(browser, "return document.getElementById('model').options.length > 0"))
        assert js(browser, "return localStorage.length") == 0  # kept for this tab only
        set_fields(browser, max_tokens=12)
        send(browser, "Hark")
        a = wait_for(lambda: (a := answer(browser)) and a["done"] and a, what="the answer")
        assert a["finish"] in ("length", "stop") and a["text"]
        errors = [e for e in console_errors(browser) if "401" not in e]  # the first, keyless call was refused
        assert errors == []
    finally:
        browser.get("about:blank")  # no page left polling a server that stops
        s.stop()


def test_n_answers_side_by_side_with_logprob_colours(server, browser):
    open_page(browser, server.url)
    set_fields(browser, max_tokens=10, n=2, seed=7, extra='{"ignore_eos": true}')
    js(browser, "document.getElementById('logprobs').checked = true")
    send(browser, "Once more")
    wait_for(lambda: js(browser, "return document.querySelector('.turn:last-child.done') !== null"))
    answers = js(
        browser,
        """return [...document.querySelectorAll('.turn:last-child .answer')].map(a =>
        ({index: a.dataset.index, tokens: a.dataset.tokens, text: a.querySelector('.text').textContent,
          spans: [...a.querySelectorAll('.tok')].map(s => s.textContent).join(''),
          coloured: [...a.querySelectorAll('.tok')].every(s => s.style.background.startsWith('rgb'))}))""",
    )
    assert [a["index"] for a in answers] == ["0", "1"]
    for a in answers:  # every token's probability in its colour: the whole answer sits in coloured spans
        assert a["tokens"] == "10" and a["text"] and a["spans"] == a["text"] and a["coloured"]


def test_completions_mode_and_the_json_schema_box(server, browser):
    open_page(browser, server.url)
    set_fields(browser, mode="completions", max_tokens=8, extra='{"ignore_eos": true}')
    send(browser, "ROMEO:")
    a = wait_for(lambda: (a := answer(browser)) and a["done"] and a, what="the completion")
    assert a["tokens"] == "8" and a["finish"] == "length" and a["text"]
    set_fields(browser, mode="chat", max_tokens=60, extra="", schema="{not json")
    send(browser, "Art thou well?")
    assert "the JSON schema is not valid JSON" in js(browser, "return document.getElementById('status').textContent")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    set_fields(browser, schema=json.dumps(schema))
    browser.find_element(By.ID, "send").click()
    a = wait_for(lambda: (a := answer(browser)) and a["done"] and a, timeout=60, what="the structured answer")
    assert isinstance(json.loads(a["text"])["ok"], bool)


def test_the_router_page_shows_its_replicas(server, browser, tmp_path):
    from tests.router.conftest import router_process

    with router_process(tmp_path, "--replica", server.url) as url:
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json={"prompt": "KING:", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200
        open_page(browser, url, "dashboard")
        row = f"#replica-table tr[data-replica='{server.url}']"
        cells = wait_for(lambda: js(browser, f"const r = document.querySelector(\"{row}\"); "
                                             "return r && [...r.cells].map(c => c.textContent)"))  # fmt: skip
        assert cells[1] == "healthy" and cells[4] == "2" and cells[5] == "100.0 %"
        m = metrics(url)
        shown = js(browser, "return document.getElementById('r-requests').dataset.value")
        assert float(shown) == total(m, "fulcrum_router:requests_total") == 2
        assert js(browser, "return document.getElementById('engine-view').hidden") is True
        assert console_errors(browser) == []
