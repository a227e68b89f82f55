"""A soak: 200 concurrent clients mixing streamed, non-streamed, aborted-mid-stream and invalid requests
for a bounded time. Nothing is lost (each request ends with its tokens or an error in OpenAI's shape) and
no request or KV block is left behind."""

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.server.test_fuzz import settle
from tests.servers import start_server

KINDS = ("stream", "plain", "abort", "invalid", "chat")


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


async def soak(url: str, clients: int, seconds: float) -> dict[str, int]:
    # idle connections expire before uvicorn's 5 s keep-alive does: else a request can go out on a connection the
    # server is closing at that moment (HTTP keep-alive's own race, which clients avoid the same way)
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10, keepalive_expiry=2)
    counts = dict.fromkeys(("done", "aborted", "refused"), 0)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def run_client(i: int):
            rng = random.Random(i)
            while time.monotonic() < deadline:
                counts[await one(client, rng.choice(KINDS), rng)] += 1

        await asyncio.gather(*(run_client(i) for i in range(clients)))
    return counts


def run_soak(tmp_path, clients: int, seconds: float):
    s = start_server(tmp_path)
    try:
        counts = asyncio.run(soak(s.url, clients, seconds))
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
