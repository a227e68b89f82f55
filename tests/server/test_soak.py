"""A soak: 200 concurrent clients mixing streamed, non-streamed, aborted-mid-stream and invalid requests
for a bounded time. Nothing is lost (each request ends with its tokens or an error in OpenAI's shape) and
no request or KV block is left behind. In the hostile soak a few of the clients send oversized bodies and
pathological schemas meanwhile: the others' latency stays that of a clean run, /health answers within a second
throughout (never two probes in a row slower: a Kubernetes probe, 1 s timeout, fails a pod after three), and the
counters come back to 0 (issue 37)."""

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.server.test_fuzz import HOSTILE_SCHEMAS, settle
from tests.servers import start_server

KINDS = ("stream", "plain", "abort", "invalid", "chat")
HOSTILE = ("oversized", "schema")
MAX_BODY_MB = 4  # the soak's server limit: an oversized body is a few MB, not the default's 32


async def hostile(client: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
    """What an attacker sends: a body past the limit (413), or a schema that must be refused or fail to compile
    within its limits (400), never a hang, a 5xx or a slower server for everyone else."""
    if kind == "oversized":
        body = {"prompt": "x" * (MAX_BODY_MB << 20), "max_tokens": 4}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text[:300]
        return "refused"
    schema = rng.choice(HOSTILE_SCHEMAS)
    body = {"prompt": "ROMEO:", "max_tokens": 8, "response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema}}}  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, (r.status_code, r.text[:300])
    return "refused"


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
    """Run one request of a kind; returns how it ended. Raises on anything a client must never see."""
    n = rng.randint(1, 12)
    body = {"prompt": rng.choice(["ROMEO:", "JULIET:", "To be, or not"]), "max_tokens": n, "ignore_eos": True}
    if kind == "invalid":
        field, value = rng.choice([("top_p", 2**64), ("priority", 2**64), ("stop_token_ids", [99999]), ("n", -3)])
        body[field] = value
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
        return "refused"
    if kind == "chat":
        chat = {k: v for k, v in body.items() if k != "prompt"}  # chat takes no prompt: it would be a 400
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **chat})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
        return "done"
    if kind == "plain":
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
        return "done"
    body.update(stream=True, max_tokens=n + 40 if kind == "abort" else n)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if kind == "abort" and len(events) == 2:
                    return "aborted"  # leaving the block closes the connection mid-stream
    assert events[-1] == "[DONE]", events[-3:]
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length", events[-3:]
    return "done"


async def soak(
    url: str, clients: int, seconds: float, hostile_clients: int = 0
) -> tuple[dict, list[float], list[float]]:
    """Counts of how requests ended, the latencies of the normal clients' requests that ran to the end, and the
    times of the /health answers in order (polled every 0.2 s throughout)."""
    # idle connections expire before uvicorn's 5 s keep-alive does: else a request can go out on a connection the
    # server is closing at that moment (HTTP keep-alive's own race, which clients avoid the same way)
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10, keepalive_expiry=2)
    counts = dict.fromkeys(("done", "aborted", "refused"), 0)
    latencies: list[float] = []
    health: list[float] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def run_client(i: int):
            rng = random.Random(i)
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                ended = await one(client, rng.choice(KINDS), rng)
                counts[ended] += 1
                if ended == "done":
                    latencies.append(time.perf_counter() - t0)

        async def run_hostile(i: int):
            rng = random.Random(-1 - i)
            while time.monotonic() < deadline:
                counts[await hostile(client, rng.choice(HOSTILE), rng)] += 1

        async def probe_health():
            async with httpx.AsyncClient(base_url=url, timeout=30) as probe:  # its own connection, as a kubelet's
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    assert (await probe.get("/health")).status_code == 200
                    health.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.2)

        await asyncio.gather(
            *(run_client(i) for i in range(clients - hostile_clients)),
            *(run_hostile(i) for i in range(hostile_clients)),
            probe_health(),
        )
    return counts, latencies, health


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def slow_in_a_row(health: list[float]) -> float:
    """The slowest that two /health answers in a row both were: what a probe that fails after consecutive timeouts
    sees (a single answer held up by the scheduler of a loaded machine fails no probe)."""
    return max(min(a, b) for a, b in zip(health, health[1:]))


def run_soak(tmp_path, clients: int, seconds: float):
    s = start_server(tmp_path)
    try:
        counts, _, _ = asyncio.run(soak(s.url, clients, seconds))
        assert all(counts.values()), counts
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert settle(s) == [0, 0, 0]  # no running or waiting request, no KV block held
    finally:
        s.stop()


def test_soak_200_clients(tmp_path):
    run_soak(tmp_path, clients=200, seconds=15)


@pytest.mark.slow
def test_soak_long(tmp_path):
    run_soak(tmp_path, clients=200, seconds=180)


def test_hostile_soak_leaves_the_others_their_latency(tmp_path):
    """50 clients, 4 of them hostile, against a clean run of the same 46 on the same server."""
    s = start_server(tmp_path, "--max-request-body-mb", str(MAX_BODY_MB), "--grammar-compile-memory", "256")
    try:
        clean, clean_lat, clean_health = asyncio.run(soak(s.url, 46, 12))
        counts, lat, health = asyncio.run(soak(s.url, 50, 12, hostile_clients=4))
        print(f"p99 latency: clean {p99(clean_lat):.3f} s ({len(clean_lat)} requests), with hostile clients "
              f"{p99(lat):.3f} s ({len(lat)}); /health slowest {max(clean_health):.3f} / {max(health):.3f} s, "
              f"two in a row {slow_in_a_row(clean_health):.3f} / {slow_in_a_row(health):.3f} s; {counts}")  # fmt: skip
        assert counts["refused"] and counts["done"]
        # /health under a second whatever the hostile clients send, never twice in a row slower; on a machine so
        # loaded that the clean run's already is, no slower than twice that. No single answer near a hang.
        assert slow_in_a_row(health) < max(1.0, 2 * slow_in_a_row(clean_health))
        assert max(health) < 5.0
        # the same clients finish about as fast (this machine's noise is wide: a hang or a serialised server shows
        # as several times slower, not as a few tenths)
        assert p99(lat) < 2 * p99(clean_lat) + 0.5
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert settle(s) == [0, 0, 0]
    finally:
        s.stop()
