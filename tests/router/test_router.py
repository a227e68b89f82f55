"""The router over two real replicas, through the official openai client: each policy routes as specified,
streamed and not."""

from __future__ import annotations

import time

import httpx

from tests.router.conftest import router_process, run_router
from tests.servers import MODEL

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def complete(client, prompt=PROMPT, stream=False, max_tokens=4, **kw):
    if stream:
        chunks = list(client.completions.create(model="shakespeare", prompt=prompt, max_tokens=max_tokens,
                                                stream=True, **kw))  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model="shakespeare", prompt=prompt, max_tokens=max_tokens, **kw).choices[0].text


def test_round_robin_streamed_and_not(replicas):
    with run_router([s.url for s in replicas], policy="round-robin") as r:
        client = r.client()
        for i in range(4):
            assert complete(client, stream=bool(i % 2))
        chat = client.chat.completions.create(
            model="shakespeare", messages=[{"role": "user", "content": "Speak."}], max_tokens=3
        )
        assert chat.choices[0].message.content is not None
        streamed = client.chat.completions.create(
            model="shakespeare", messages=[{"role": "user", "content": "Speak."}], max_tokens=3, stream=True
        )
        assert any(c.choices and c.choices[0].delta.content for c in streamed)
        assert sorted(r.requests_by_replica().values()) == [3, 3]
        assert [m.id for m in client.models.list()] == ["shakespeare"]
        assert httpx.get(f"{r.url}/health").status_code == 200 and httpx.get(f"{r.url}/ping").status_code == 200
        # the rest of fulcrum serve's API, answered by a replica
        direct = httpx.post(f"{replicas[0].url}/tokenize", json={"prompt": PROMPT}).json()
        routed = httpx.post(f"{r.url}/tokenize", json={"prompt": PROMPT})
        assert routed.status_code == 200 and routed.json() == direct
        text = httpx.post(f"{r.url}/detokenize", json={"tokens": direct["tokens"]}).json()
        assert text["prompt"] == PROMPT
        assert httpx.post(f"{r.url}/tokenize", json={"prompt": 3}).status_code == 400  # the replica's own check
        assert httpx.get(f"{r.url}/version").json() == httpx.get(f"{replicas[0].url}/version").json()
        text = httpx.get(f"{r.url}/metrics").text
        assert 'fulcrum_router:decisions_total{reason="round-robin"} 6.0' in text


def test_bad_request_is_a_400_in_openai_shape(replicas):
    with run_router([s.url for s in replicas]) as r:
        resp = httpx.post(f"{r.url}/v1/completions", json={"model": "shakespeare", "prompt": "x", "max_tokens": -1})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == 400
        # issue 37: the router's own errors in the server's shape too: an unknown route, deep JSON
        for resp in (
            httpx.get(f"{r.url}/v1/nothing-here"),
            httpx.post(f"{r.url}/v1/completions", content=b"[" * 100_000, headers={"content-type": "application/json"}),
        ):
            assert resp.status_code in (400, 404) and set(resp.json()["error"]) >= {"message", "type", "code"}


def test_the_api_key_guards_every_api_route_as_the_servers_does(replicas):
    """Issue 37: with --api-key the router asked for it on generation only; /v1/models (which the server guards)
    was open. Health, metrics and the docs stay open on both."""
    with run_router([s.url for s in replicas], api_key="sesame") as r:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")]:
            resp = httpx.request(method, f"{r.url}{path}", json={"prompt": "x"})
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError", path
        ok = httpx.get(f"{r.url}/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "shakespeare"
        for path in ("/health", "/metrics", "/openapi.json"):
            assert httpx.get(f"{r.url}{path}").status_code == 200, path


def test_least_load_avoids_the_busy_replica(replicas):
    with run_router([s.url for s in replicas], policy="least-load") as r:
        busy, idle = r.router.pool.replicas[replicas[0].url], r.router.pool.replicas[replicas[1].url]
        busy.in_flight += 5  # as if five requests were running there
        try:
            client = r.client()
            for stream in (False, True, False):
                assert complete(client, stream=stream)
        finally:
            busy.in_flight -= 5
        assert r.requests_by_replica() == {idle.url: 3}


def test_prefix_lands_on_the_holder_and_the_guard_overrides(replicas):
    system = "You are a herald of Verona. " * 12  # several blocks of shared prefix
    with run_router([s.url for s in replicas], policy="prefix", balance_margin=2) as r:
        client = r.client()
        complete(client, prompt=system + "Who comes?")
        (holder,) = r.requests_by_replica()
        for i, stream in enumerate((False, True, False, True)):
            complete(client, prompt=system + f"Question {i}?", stream=stream)
        assert r.requests_by_replica() == {holder: 5}
        assert r.decisions()["prefix"] == 4
        # saturate the holder: its load now exceeds the other's by more than the margin
        pool = r.router.pool
        pool.replicas[holder].in_flight += 3
        try:
            complete(client, prompt=system + "And now?", stream=True)
        finally:
            pool.replicas[holder].in_flight -= 3
        other = next(u for u in pool.replicas if u != holder)
        assert r.requests_by_replica()[other] == 1
        assert r.decisions()["load-guard"] == 1
        r.router.metrics.collect()  # refreshes the gauges
        assert r.router.metrics.hit_rate._value.get() > 0.5


def test_weighted_prefers_the_holder_until_load_outweighs(replicas):
    system = "The king's speech before Agincourt, once more. " * 10
    with run_router([s.url for s in replicas], policy="weighted", prefix_weight=1.0, load_weight=0.2) as r:
        client = r.client()
        complete(client, prompt=system + "Go.")
        (holder,) = r.requests_by_replica()
        complete(client, prompt=system + "On.", stream=True)
        assert r.requests_by_replica() == {holder: 2}
        r.router.pool.replicas[holder].in_flight += 10  # 10 * 0.2 outweighs a whole prompt cached
        try:
            complete(client, prompt=system + "Up.")
        finally:
            r.router.pool.replicas[holder].in_flight -= 10
        assert len(r.requests_by_replica()) == 2


def test_sticky_user(replicas):
    with run_router([s.url for s in replicas], policy="round-robin", sticky_user=True) as r:
        client = r.client()
        for _ in range(3):
            complete(client, user="alice")
        assert sorted(r.requests_by_replica().values()) == [3]


def test_discover_finds_replicas_by_dns(replicas):
    port = replicas[0].port
    with run_router([], discover=f"localhost:{port}") as r:
        deadline = time.time() + 10
        while not r.router.pool.available():
            assert time.time() < deadline, r.router.pool.replicas
            time.sleep(0.1)
        assert f"http://127.0.0.1:{port}" in {x.url for x in r.router.pool.available()}
        assert complete(r.client())


def test_the_cli_runs_the_router(replicas, tmp_path):
    flags = ["--policy", "prefix", "--model", str(MODEL), *[a for s in replicas for a in ("--replica", s.url)]]
    with router_process(tmp_path, *flags) as url:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert complete(client, stream=True)
        assert "fulcrum_router:decisions_total" in httpx.get(f"{url}/metrics").text
