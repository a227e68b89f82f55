"""OpenAI's Responses API through the official `openai` client: a plain response, a streamed one (its text deltas make
the final text), a function call whose output goes back through previous_response_id, text.format json_schema,
GET and DELETE of a stored response, a reasoning model's thought as a reasoning item, and an unknown field refused with a 400 naming it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.test_reasoning import thinking_server  # noqa: F401  (a fixture: a --reasoning-parser server)
from tests.servers import start_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
    "strict": True,
}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"), "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_a_plain_response(client):
    r = client.responses.create(
        model="shakespeare", instructions="You are a poet.", input="ROMEO:", max_output_tokens=12,
        metadata={"run": "plain"},
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "shakespeare"
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text
    assert r.status in ("completed", "incomplete") and r.metadata == {"run": "plain"}
    assert (r.status == "incomplete") == (r.usage.output_tokens == 12)
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_streamed_deltas_make_the_final_text(client):
    kw = dict(model="shakespeare", input=[{"role": "user", "content": "JULIET:"}], max_output_tokens=16, temperature=0)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == deltas
    assert final.usage.output_tokens > 0
    # the SDK's helper accumulates the events into its snapshot (it raises on an event it cannot place); it returns
    # a final response only for response.completed, and a max_output_tokens cut is response.incomplete
    with client.responses.stream(**kw) as stream:
        helped = list(stream)
    assert helped[-1].type == kinds[-1] and helped[-1].response.output_text == deltas  # greedy: the same text


def test_a_function_call_round_trip(client):
    first = client.responses.create(
        model="shakespeare", input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=100,
    )  # fmt: skip
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    answer = client.responses.create(
        model="shakespeare", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.previous_response_id == first.id and answer.output_text
    # the first turn (its input and its call) is in the prompt, and was cached
    assert answer.usage.input_tokens > first.usage.input_tokens
    assert answer.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_function_call(client):
    events = list(client.responses.create(
        model="shakespeare", input="Weather in Rome?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=100,
        stream=True,
    ))  # fmt: skip
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments and json.loads(args)["city"] in ("Paris", "Rome")
    call = next(o for o in events[-1].response.output if o.type == "function_call")
    assert call.arguments == args and call.name == "get_weather"


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["Romeo", "Juliet"]}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="shakespeare", input="Who?", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_get_and_delete_a_stored_response(client, server):
    r = client.responses.create(model="shakespeare", input="ROMEO:", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    gone = httpx.delete(f"{server.url}/v1/responses/{r.id}")
    assert gone.status_code == 200 and gone.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unkept = client.responses.create(model="shakespeare", input="ROMEO:", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="shakespeare", input="x", previous_response_id=unkept.id)
    assert e.value.body["param"] == "previous_response_id"


def test_an_unknown_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="shakespeare", input="x", extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.message and e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="shakespeare", input="x", truncation="auto")
    assert e.value.body["param"] == "truncation"


@pytest.fixture(scope="module")
def thinking_client(thinking_server):  # noqa: F811
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="none", max_retries=0)


def test_a_reasoning_model_gives_a_reasoning_item(thinking_client):
    # the tiny model never writes </think> unforced: the whole answer is a thought cut by max_output_tokens
    kw = dict(model="shakespeare", input="Think first.", max_output_tokens=24, temperature=0)
    r = thinking_client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"
    thought = r.output[0].content[0].text
    assert thought and r.output_text == ""
    events = list(thinking_client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought and events[-1].response.output[0].content[0].text == thought
