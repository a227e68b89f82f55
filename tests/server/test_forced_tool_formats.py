"""Forced tool calls (tool_choice required or a named function) under each tool-call parser: the grammar writes the
call in the parser's own format where its arguments are a JSON object (DeepSeek-V3's fenced call, Qwen3-Coder's
parser reading Hermes' form), and in Hermes' format where they are not (pythonic keyword arguments); either way the
answer holds a valid call, whole and streamed."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.servers import start_server

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"]},
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=["deepseek_v3", "pythonic", "qwen3_coder"])
def server(request, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"), "--tool-call-parser", request.param)
    yield s
    s.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_comes_back_as_a_call(server, choice):
    body = {"model": "shakespeare", "messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL],
            "tool_choice": choice, "max_tokens": 120, "parallel_tool_calls": False}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    streamed += ch["delta"].get("tool_calls") or []
    assert [c["function"]["name"] for c in streamed] == ["get_weather"]
