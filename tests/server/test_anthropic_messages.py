"""Anthropic's Messages API through the official `anthropic` client: a plain message, a tool_use round trip (the
tool_result sent back), count_tokens, and errors the SDK parses (Anthropic's shape), with the key as x-api-key."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from tests.servers import start_server  # noqa: E402

KEY = "sk-test-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"), "--api-key", KEY, "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_a_plain_message(client):
    msg = client.messages.create(
        model="shakespeare", max_tokens=12, system="You are a poet.",
        messages=[{"role": "user", "content": "ROMEO:"}],
    )  # fmt: skip
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.input_tokens > 0
    assert (msg.stop_reason == "max_tokens") == (msg.usage.output_tokens == 12)


def test_a_tool_use_round_trip(client):
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    msg = client.messages.create(
        model="shakespeare", max_tokens=100, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=asked,
    )  # fmt: skip
    use = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use and use[0].name == "get_weather" and "city" in use[0].input
    answer = client.messages.create(
        model="shakespeare", max_tokens=8, tools=[WEATHER],
        messages=[*asked, {"role": "assistant", "content": msg.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "sunny"}]}],
    )  # fmt: skip

    def prompt(m):  # Anthropic counts tokens read from the cache apart from input_tokens
        return m.usage.input_tokens + m.usage.cache_read_input_tokens

    assert prompt(answer) > prompt(msg)  # the call and its result are in the prompt
    assert answer.usage.cache_read_input_tokens > 0  # the first turn's prefix was cached


def test_count_tokens(client):
    n = client.messages.count_tokens(model="shakespeare", messages=[{"role": "user", "content": "ROMEO:"}])
    longer = client.messages.count_tokens(model="shakespeare", messages=[{"role": "user", "content": "ROMEO: " * 9}])
    assert 0 < n.input_tokens < longer.input_tokens


def test_errors_have_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="shakespeare", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="shakespeare", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "shakespeare", "max_tokens": 4, "messages": [], "bogus": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_streamed_events_build_the_same_message(client):
    kw = dict(
        model="shakespeare",
        max_tokens=16,
        messages=[{"role": "user", "content": "ROMEO:"}],
        extra_body={"temperature": 0},
    )  # greedy: the SDK no longer names the field
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    types = []
    with client.messages.create(**kw, stream=True) as events:
        types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(types)


def test_a_streamed_tool_use(client):
    with client.messages.stream(
        model="shakespeare", max_tokens=100, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    use = [b for b in final.content if b.type == "tool_use"]
    assert (
        final.stop_reason == "tool_use" and use[0].name == "get_weather" and use[0].input["city"] in ("Paris", "Rome")
    )


def test_a_streamed_stop_sequence_is_named(client, server):
    kw = dict(model="shakespeare", max_tokens=24, messages=[{"role": "user", "content": "ROMEO:"}],
              extra_body={"temperature": 0})  # fmt: skip
    free = client.messages.create(**kw).content[0].text
    words = free.split()
    assert len(words) > 2, free
    stop = words[2]  # a word the model really writes, after some text
    before = free[: free.index(stop)]
    whole = client.messages.create(**kw, stop_sequences=["never-written", stop])
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**kw, stop_sequences=["never-written", stop]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == before == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    with client.messages.create(**kw, stop_sequences=[stop], stream=True) as events:
        delta = [e for e in events if e.type == "message_delta"][0].delta
    assert (delta.stop_reason, delta.stop_sequence) == ("stop_sequence", stop)
    # the chat path's streamed chunks name it on the finishing choice, as vLLM's
    body = {"model": "shakespeare", "max_tokens": 24, "temperature": 0, "stop": [stop], "stream": True,
            "messages": [{"role": "user", "content": "ROMEO:"}]}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": KEY}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for line in lines for c in json.loads(line)["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == before
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices if c["finish_reason"]] == [("stop", stop)]
    assert all(c["stop_reason"] is None for c in choices if not c["finish_reason"])
