"""Hostile and fuzzed requests on the routes built on the chat path: `/v1/responses` (OpenAI's error shape) and
Anthropic's `/v1/messages` and `/v1/messages/count_tokens` (Anthropic's error shape). Whatever a client sends (wrong
types, unknown fields, huge numbers, empty content, bodies that are no JSON, hostile tool schemas, a
previous_response_id never stored), the answer is a 200 with a body the official SDK reads or a 4xx in the route's
error shape, never a 5xx; a client gone mid-stream is aborted; afterwards the server holds no request and no KV block
and gives the same greedy text as before."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from fulcrum.protocol import ErrorResponse
from fulcrum.server.anthropic_messages import ERROR_TYPES as ANTHROPIC_ERROR_TYPES
from tests.server.test_fuzz import (
    BAD_FLOAT,
    BAD_INT,
    FUZZ_FLAGS,
    HOSTILE_SCHEMAS,
    JUNK,
    bad_text,
    object_schemas,
    settle,
    text,
)
from tests.server.test_fuzz import schemas as json_schemas
from tests.server.test_http_errors import metric
from tests.servers import start_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MESSAGE = TypeAdapter(anthropic.types.Message)
MESSAGE_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
TOKEN_COUNT = TypeAdapter(anthropic.types.MessageTokensCount)
RESPONSE = TypeAdapter(openai.types.responses.Response)
RESPONSE_EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
STORED = "<a stored response>"  # a previous_response_id drawn: replaced by one the server has stored
stored_ids: list[str] = []
GREEDY_CHAT = {"model": "shakespeare", "messages": [{"role": "user", "content": "ROMEO:"}], "max_tokens": 8,
               "temperature": 0}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"), *FUZZ_FLAGS)
    s.greedy_before = greedy_text(s)
    yield s
    s.stop()


def greedy_text(server) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=GREEDY_CHAT, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def sse_data(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


def check(url: str, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    """The answer is a 200 the official SDK's types read or a 4xx in the route's error shape."""
    if content is None:
        if path == RESPONSES and isinstance(body, dict) and body.get("previous_response_id") == STORED:
            body = {**body, "previous_response_id": random.choice(stored_ids) if stored_ids else "resp_none_yet"}
        content = json.dumps(body, allow_nan=True, ensure_ascii=True).encode()
    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        if path == RESPONSES:
            err = ErrorResponse.model_validate(r.json()).error
            assert err.code == r.status_code and err.message
        else:
            got = r.json()
            assert got["type"] == "error" and set(got["error"]) == {"type", "message"}, got
            assert got["error"]["type"] == ANTHROPIC_ERROR_TYPES[r.status_code] and got["error"]["message"]
        return r
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_data(r.text)
        assert all(e["type"] != "error" for e in events), r.text
        adapter = MESSAGE_EVENT if path == MESSAGES else RESPONSE_EVENT
        for e in events:
            adapter.validate_python(e)
        if path == MESSAGES:
            assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        else:
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
            final = events[-1]["response"]
            if final["store"]:
                stored_ids.append(final["id"])
        return r
    if path == MESSAGES:
        MESSAGE.validate_python(r.json())
    elif path == COUNT:
        assert TOKEN_COUNT.validate_python(r.json()).input_tokens > 0
    else:
        response = RESPONSE.validate_python(r.json())
        if response.store:
            stored_ids.append(response.id)
    return r


# -- hand-picked: each refused with the status it names, in the route's shape, the field named where it can be ------

HI = [{"role": "user", "content": "hi"}]
MSG = {"model": "shakespeare", "max_tokens": 4, "messages": HI}
COUNT_BODY = {"model": "shakespeare", "messages": HI}
TOOL = {"name": "f", "input_schema": {"type": "object"}}
DEEP = b"[" * 100_000 + b"]" * 100_000


def tool_with(schema):
    return {"name": "f", "input_schema": schema}


CASES = [
    # bodies that are no JSON, or JSON of the wrong kind
    (MESSAGES, b'{"model": "shakespeare",', 400, "JSON"),
    (MESSAGES, b"", 400, "JSON"),
    (MESSAGES, DEEP, 400, "nested too deeply"),
    (MESSAGES, b"\xff\xfe", 400, "JSON"),
    (MESSAGES, b"[]", 400, "MessagesRequest"),
    (MESSAGES, b"null", 400, "MessagesRequest"),
    (MESSAGES, b'{"model": "shakespeare", "max_tokens": ' + b"9" * 5000 + b', "messages": []}', 400, "JSON"),
    (
        MESSAGES,
        b'{"model": "shakespeare", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
        b'"temperature": NaN}',
        400,
        "temperature",
    ),  # fmt: skip
    (
        MESSAGES,
        b'{"model": "shakespeare", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}',
        400,
        "top_p",
    ),  # fmt: skip
    (
        MESSAGES,
        b'{"model": "shakespeare", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800"}]}',
        400,
        "UTF-8",
    ),  # fmt: skip
    (COUNT, DEEP, 400, "nested too deeply"),
    (COUNT, b"[1, 2", 400, "JSON"),
    (RESPONSES, DEEP, 400, "nested too deeply"),
    (RESPONSES, b'{"input": "hi",', 400, "JSON"),
    (RESPONSES, b"null", 400, "ResponsesRequest"),
    (RESPONSES, b'{"input": "hi", "max_output_tokens": ' + b"9" * 5000 + b"}", 400, "JSON"),
    (RESPONSES, b'{"input": "hi", "temperature": Infinity}', 400, "temperature"),
    (RESPONSES, b'{"input": "a\\udc00"}', 400, "input"),
    # wrong types and unknown fields
    (MESSAGES, {**MSG, "max_tokens": "4"}, 400, "max_tokens"),
    (MESSAGES, {**MSG, "messages": "hi"}, 400, "messages"),
    (MESSAGES, {**MSG, "stream": "yes"}, 400, "stream"),
    (MESSAGES, {**MSG, "stop_sequences": "\n"}, 400, "stop_sequences"),
    (MESSAGES, {**MSG, "stop_sequences": [None]}, 400, "stop_sequences"),
    (MESSAGES, {**MSG, "system": [{"type": "image"}]}, 400, "system"),
    (MESSAGES, {**MSG, "n": 2}, 400, "n"),
    (MESSAGES, {**MSG, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    (MESSAGES, {**MSG, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "name"),
    (MESSAGES, {**MSG, "model": "claude-nope"}, 404, "claude-nope"),
    (MESSAGES, {**MSG, "model": 3}, 400, "model"),
    (COUNT, {**COUNT_BODY, "max_tokens": 4}, 400, "max_tokens"),
    (COUNT, {**COUNT_BODY, "model": None}, 400, "model"),
    (RESPONSES, {"input": 3}, 400, "input"),
    (RESPONSES, {"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    (RESPONSES, {"input": "hi", "metadata": {"a": 1}}, 400, "metadata.a"),
    (RESPONSES, {"input": "hi", "stream": "yes"}, 400, "stream"),
    (RESPONSES, {"input": [{"type": "image"}]}, 400, "input"),
    (RESPONSES, {"input": [{"role": "wizard", "content": "x"}]}, 400, "input"),
    (RESPONSES, {"input": "hi", "model": "gpt-nope"}, 404, "gpt-nope"),
    # huge numbers
    (MESSAGES, {**MSG, "max_tokens": 2**64}, 400, "max_tokens"),
    (MESSAGES, {**MSG, "max_tokens": 5000}, 400, "max_tokens"),
    (MESSAGES, {**MSG, "top_k": 2**64}, 400, "top_k"),
    (MESSAGES, {**MSG, "top_p": 1e-50}, 400, "top_p"),
    (MESSAGES, {**MSG, "temperature": 1e308}, 400, "temperature"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 2**64}, 400, "max_output_tokens"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 5000}, 400, "max_tokens"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    (RESPONSES, {"input": "hi", "top_p": 1e-50}, 400, "top_p"),
    (RESPONSES, {"input": "word " * 50_000}, 400, "context length"),
    (MESSAGES, {**MSG, "messages": [{"role": "user", "content": "word " * 50_000}]}, 400, "context length"),
    # empty content
    (MESSAGES, {**MSG, "messages": []}, 400, "messages"),
    (MESSAGES, {**MSG, "messages": [{"role": "user", "content": []}]}, 400, "messages"),
    (MESSAGES, {**MSG, "stop_sequences": [""]}, 400, "stop_sequences"),
    (COUNT, {**COUNT_BODY, "messages": []}, 400, "messages"),
    (RESPONSES, {"input": []}, 400, "input"),
    (RESPONSES, {"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
    # tools: hostile schemas, names, choices
    (MESSAGES, {**MSG, "tools": [{"name": "x y", "input_schema": {}}]}, 400, "name"),
    (MESSAGES, {**MSG, "tools": [{"name": "f"}]}, 400, "input_schema"),
    (MESSAGES, {**MSG, "tools": [tool_with({"type": "strin"})], "tool_choice": {"type": "any"}}, 400, "schema"),
    (
        MESSAGES,
        {**MSG, "tools": [tool_with({"$ref": "file:///etc/passwd"})], "tool_choice": {"type": "any"}},
        400,
        "schema",
    ),  # fmt: skip
    (MESSAGES, {**MSG, "tools": [tool_with("a string")]}, 400, "input_schema"),
    (MESSAGES, {**MSG, "tools": [TOOL, TOOL]}, 400, "distinct"),
    (MESSAGES, {**MSG, "tools": [TOOL], "tool_choice": {"type": "tool"}}, 400, "name"),
    (MESSAGES, {**MSG, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}}, 400, "'g'"),
    (MESSAGES, {**MSG, "tool_choice": {"type": "any"}}, 400, "tools"),
    (
        MESSAGES,
        {**MSG, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
        400,
        "assistant",
    ),  # fmt: skip
    (
        MESSAGES,
        {**MSG, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
        400,
        "user",
    ),  # fmt: skip
    (MESSAGES, {**MSG, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "reasoning"),
    (COUNT, {**COUNT_BODY, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}}, 400, "'g'"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "x y"}]}, 400, "name"),
    (
        RESPONSES,
        {
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "strin"}}],
            "tool_choice": "required",
        },
        400,
        "schema",
    ),  # fmt: skip
    (RESPONSES, {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    (
        RESPONSES,
        {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
        400,
        "'g'",
    ),  # fmt: skip
    (
        RESPONSES,
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/x"}}}},
        400,
        "schema",
    ),  # fmt: skip
    (RESPONSES, {"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.schema"),
    (
        RESPONSES,
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]},
        400,
        "arguments",
    ),  # fmt: skip
    # previous_response_id never stored
    (RESPONSES, {"input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    (RESPONSES, {"input": "hi", "previous_response_id": ""}, 400, "previous_response_id"),
    (RESPONSES, {"input": "hi", "previous_response_id": 7}, 400, "previous_response_id"),
]


@pytest.mark.parametrize("path, body, status, named", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_hostile_bodies_are_refused_in_the_routes_shape(server, path, body, status, named):
    raw = body if isinstance(body, bytes) else None
    r = check(server.url, path, None if raw else body, raw)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    param = r.json()["error"].get("param") or ""
    assert named in message or named in param, (named, r.text)


def test_unknown_stored_responses_are_404(server):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.url}/v1/responses/resp_nope", timeout=30)
        assert r.status_code == 404 and ErrorResponse.model_validate(r.json()).error.param == "response_id"


LONG = {"type": "object", "properties": {"line": {"type": "string", "minLength": 700}}, "required": ["line"]}


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
def test_a_client_gone_mid_stream_is_aborted_and_holds_nothing(server, path):
    # a grammar keeps the answer going (~2 s here): a forced tool call with a long argument, or a long JSON text
    body = (
        {**MSG, "max_tokens": 800, "stream": True, "tools": [{"name": "say", "input_schema": LONG}],
         "tool_choice": {"type": "tool", "name": "say"}}
        if path == MESSAGES
        else {"input": "ROMEO:", "max_output_tokens": 900, "stream": True,
              "text": {"format": {"type": "json_schema", "name": "say", "schema": LONG}}}
    )  # fmt: skip
    aborted = 'fulcrum:request_success_total{finished_reason="abort"'
    before = metric(server, aborted) if aborted in httpx.get(f"{server.url}/metrics").text else 0
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    assert settle(server) == [0, 0, 0]
    assert metric(server, aborted) == before + 1


# -- fuzzed: a valid body, and in half the examples one or two of its fields broken -------------------------------

NAMES = st.sampled_from(["get_weather", "get_time", "f"])
BAD_MAX = st.sampled_from([0, -1, 5000, 2**64, True, "4", 2.5])
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text})
anthropic_tool = st.builds(lambda name, schema: {"name": name, "input_schema": schema}, NAMES, object_schemas)
bad_anthropic_tools = (
    st.lists(
        st.builds(lambda s: {"name": "bad", "input_schema": s}, st.sampled_from(HOSTILE_SCHEMAS) | JUNK),
        min_size=1,
        max_size=1,
    )  # fmt: skip
    | st.sampled_from([[{"name": "f"}], [{"name": "", "input_schema": {}}], [{"type": "bash_20250124", "name": "f"}]])
    | JUNK
)
tool_use = st.builds(
    lambda name, args: {"type": "tool_use", "id": "toolu_1", "name": name, "input": args},
    NAMES, st.dictionaries(st.sampled_from(["city", "n"]), text | st.integers(), max_size=2),
)  # fmt: skip
tool_result = st.builds(lambda out: {"type": "tool_result", "tool_use_id": "toolu_1", "content": out},
                        text | st.lists(text_block))  # fmt: skip
anthropic_message = st.fixed_dictionaries(
    {"role": st.just("user"), "content": text | st.lists(text_block | tool_result, min_size=1, max_size=2)}
) | st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": text | st.lists(text_block | tool_use, min_size=1, max_size=2)}
)
bad_anthropic_message = (
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "tool", "", "user"]),
            "content": bad_text | st.just([]) | st.just([{"type": "image", "source": {}}]),
        }
    )  # fmt: skip
    | JUNK
)
ANTHROPIC = {
    "model": (st.just("shakespeare"), st.sampled_from(["claude-nope", "", "\ud800"]) | JUNK),
    "messages": (
        st.lists(anthropic_message, min_size=1, max_size=3),
        st.lists(bad_anthropic_message, max_size=2) | JUNK,
    ),
    "max_tokens": (st.integers(1, 8), BAD_MAX),
    "system": (text | st.lists(text_block, max_size=2), st.just([{"type": "image"}]) | bad_text),
    "stop_sequences": (st.lists(text.filter(bool), max_size=3), st.just([""]) | bad_text | st.just([None])),
    "temperature": (st.floats(0, 1), BAD_FLOAT),
    "top_p": (st.floats(1e-6, 1), BAD_FLOAT),
    "top_k": (st.integers(-1, 50) | st.sampled_from([2047, 2048, 2049, 2**62]), BAD_INT),
    "stream": (st.booleans(), JUNK),
    "metadata": (st.just({"user_id": "u1"}), JUNK.filter(lambda v: v is not None and not isinstance(v, dict))),
    "tools": (st.lists(anthropic_tool, min_size=1, max_size=2, unique_by=lambda t: t["name"]), bad_anthropic_tools),
    "tool_choice": (
        st.sampled_from(
            [
                {"type": "auto"},
                {"type": "any"},
                {"type": "none"},
                {"type": "tool", "name": "get_weather"},
                {"type": "auto", "disable_parallel_tool_use": True},
            ]
        ),  # fmt: skip
        st.sampled_from([{"type": "tool"}, {"type": "tool", "name": "nope"}, {"type": "always"}, "auto"]) | JUNK,
    ),
    "thinking": (st.just({"type": "disabled"}), st.just({"type": "enabled", "budget_tokens": 1024}) | JUNK),
    "some_extension": (st.nothing(), JUNK),  # unknown: only ever a broken field
}
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking")

input_part = st.fixed_dictionaries({"type": st.just("input_text"), "text": text})
input_item = (
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer"]), "content": text | st.lists(input_part, max_size=2)}
    )  # fmt: skip
    | st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.just("assistant"),
            "content": st.lists(st.fixed_dictionaries({"type": st.just("output_text"), "text": text}), max_size=1),
        }
    )  # fmt: skip
    | st.builds(
        lambda name, city: {
            "type": "function_call",
            "call_id": "call_1",
            "name": name,
            "arguments": json.dumps({"city": city}),
        },
        NAMES,
        text,
    )  # fmt: skip
    | st.builds(lambda out: {"type": "function_call_output", "call_id": "call_1", "output": out}, text)
)
bad_input_item = (
    st.sampled_from(
        [
            {"type": "image"},
            {"role": "wizard", "content": "x"},
            {"type": "message"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
        ]
    )  # fmt: skip
    | JUNK
)
function_tool = st.builds(lambda name, schema: {"type": "function", "name": name, "parameters": schema}, NAMES,
                          object_schemas)  # fmt: skip
RESPONSES_FIELDS = {
    "model": (st.just("shakespeare"), st.sampled_from(["gpt-4", "", "\ud800"]) | JUNK),
    "input": (
        text.filter(bool) | st.lists(input_item, min_size=1, max_size=3),
        bad_text | st.lists(bad_input_item, max_size=2) | JUNK,
    ),  # fmt: skip
    "instructions": (text, JUNK.filter(lambda v: v is not None and not isinstance(v, str))),
    "max_output_tokens": (st.integers(1, 8), BAD_MAX),
    "temperature": (st.floats(0, 2), BAD_FLOAT),
    "top_p": (st.floats(1e-6, 1), BAD_FLOAT),
    "tools": (
        st.lists(function_tool, min_size=1, max_size=2, unique_by=lambda t: t["name"]),
        st.lists(
            st.builds(
                lambda s: {"type": "function", "name": "bad", "parameters": s}, st.sampled_from(HOSTILE_SCHEMAS) | JUNK
            ),
            min_size=1,
            max_size=1,
        )  # fmt: skip
        | st.sampled_from([[{"type": "function"}], [{"type": "web_search"}], [3]])
        | JUNK,
    ),
    "tool_choice": (
        st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}]),
        st.sampled_from(["always", {"type": "function", "name": "nope"}, {"type": "function"}]) | JUNK,
    ),
    "parallel_tool_calls": (st.booleans(), JUNK),
    "text": (
        st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])
        | st.builds(lambda s: {"format": {"type": "json_schema", "name": "answer", "schema": s}}, json_schemas),
        st.builds(
            lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}},
            st.sampled_from(HOSTILE_SCHEMAS) | JUNK,
        )  # fmt: skip
        | st.sampled_from([{"format": {"type": "yaml"}}, {"format": {"type": "json_schema"}}])
        | JUNK,
    ),
    "stream": (st.booleans(), JUNK),
    "store": (st.booleans(), JUNK),
    "previous_response_id": (st.just(STORED), st.sampled_from(["resp_nope", ""]) | JUNK),
    "metadata": (st.just({"run": "fuzz"}), st.just({"a": 1}) | JUNK),
    "some_extension": (st.nothing(), JUNK),
}
# stream is always drawn (true in half the examples), so that streams are fuzzed as much as whole answers
REQUIRED = {MESSAGES: ("model", "messages", "max_tokens", "stream"), COUNT: ("model", "messages"),
            RESPONSES: ("input", "stream")}  # fmt: skip


@st.composite
def bodies_for(draw, path: str):
    fields = RESPONSES_FIELDS if path == RESPONSES else ANTHROPIC
    if path == COUNT:  # the sampling fields are unknown to count_tokens: drawn among the broken
        fields = {k: v if k in COUNT_FIELDS else (st.nothing(), v[1] if v[0].is_empty else v[0])
                  for k, v in fields.items()}  # fmt: skip
    optional = [f for f in fields if f not in REQUIRED[path] and not fields[f][0].is_empty]
    chosen = list(REQUIRED[path]) + draw(st.lists(st.sampled_from(optional), max_size=6, unique=True))
    if "tool_choice" in chosen and "tools" not in chosen and draw(st.booleans()):
        chosen.append("tools")
    body = {name: draw(fields[name][0]) for name in chosen}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        body[name] = draw(fields[name][1])
    return body


def fuzz(url: str, path: str, examples: int):
    @settings(max_examples=examples, deadline=None, database=None, derandomize=examples <= 300,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(bodies_for(path))
    def run(body):
        check(url, path, body)

    run()


@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES])
def test_fuzzed_bodies_never_5xx(server, path):
    fuzz(server.url, path, examples=150)


@pytest.mark.slow
@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES])
def test_fuzzed_bodies_many(server, path):
    fuzz(server.url, path, examples=2000)


def test_nothing_is_left_behind(server):
    """Last in this module: the server is alive, holds no request or KV block, and answers as before."""
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert settle(server) == [0, 0, 0]
    assert greedy_text(server) == server.greedy_before
    r = httpx.post(f"{server.url}{MESSAGES}", json={**MSG, "max_tokens": 8, "temperature": 0,
                                                      "messages": GREEDY_CHAT["messages"]}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["content"][0]["text"] == server.greedy_before
    deadline = time.time() + 5
    while metric(server, "fulcrum:num_requests_running") and time.time() < deadline:
        time.sleep(0.1)
    assert settle(server) == [0, 0, 0]
