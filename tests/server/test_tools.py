"""Tool calling over HTTP (issue 15), through the official openai client's typed objects: for each
--tool-call-parser format, tool_choice required and named functions always give valid calls (a grammar in the
parser's own format), auto reads the calls the model writes (here written under a regex), streamed deltas add up
to the whole answer, and tool turns in the history render."""

import json
import re

import jsonschema
import openai
import pytest

from fulcrum.server.tool_parsers import TOOL_PARSERS
from fulcrum.server.tools import MAX_PARALLEL_CALLS
from tests.servers import start_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Verona?"}]
# auto: the model's own text, here forced into each format by a regex (the bundled model knows no tool format)
CITY = '"city": "[a-z]{3,8}", "days": [1-7]'
AUTO_REGEX = {
    "hermes": r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{' + CITY + r"\}\}\n</tool_call>",
    "llama3_json": r'\{"name": "get_weather", "parameters": \{' + CITY + r"\}\}",
    "mistral": r'Let me look\.\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{' + CITY + r"\}\}\]",
}
AUTO_CONTENT = {"hermes": "Let me look.\n", "llama3_json": None, "mistral": "Let me look."}
PARSERS = list(AUTO_REGEX)


@pytest.fixture(scope="module", params=PARSERS)
def served(request, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("tools"), "--tool-call-parser", request.param)
    yield request.param, openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
    s.stop()


def create(client, **kw):
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 300)
    return client.chat.completions.create(model="shakespeare", messages=kw.pop("messages", MESSAGES), **kw)


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(client, **kw):
    """The stream's deltas joined per choice: content, and calls by index (id and name once, arguments joined)."""
    content, calls, finish = "", {}, None
    for chunk in create(client, stream=True, **kw):
        choice = chunk.choices[0]
        d = choice.delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def same_calls(whole, streamed_calls):
    assert [c.function.name for c in whole] == [c["name"] for c in streamed_calls]
    assert [json.loads(c.function.arguments) for c in whole] == [json.loads(c["arguments"]) for c in streamed_calls]


def test_required_always_gives_valid_calls(served):
    _, client = served
    for seed in range(6):
        r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        choice = r.choices[0]
        check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    # parallel calls (the default): the bundled model always takes another, up to the bound
    r = create(client, tools=TOOLS[1:], tool_choice="required", seed=0, max_tokens=600)
    check_calls(r.choices[0].message.tool_calls)
    assert 1 < len(r.choices[0].message.tool_calls) <= MAX_PARALLEL_CALLS


def test_named_function_and_no_parallel_calls(served):
    _, client = served
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = create(client, tools=TOOLS, tool_choice=named, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        check_calls(calls, ["get_time"])
        assert r.choices[0].finish_reason == "stop"  # OpenAI's for a named function


def test_streamed_calls_equal_the_whole_answer(served):
    _, client = served
    for seed in range(3):
        kw = dict(tools=TOOLS[seed == 0 :], tool_choice="required", seed=seed, parallel_tool_calls=seed == 0)
        kw["max_tokens"] = 600
        whole = create(client, **kw).choices[0]
        content, calls, finish = streamed(client, **kw)
        same_calls(whole.message.tool_calls, calls)
        assert content is None and finish == "tool_calls"
        assert all(re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", c["id"]) for c in calls)


def test_auto_parses_the_models_calls(served):
    parser, client = served
    extra = {"guided_regex": AUTO_REGEX[parser]}
    r = create(client, tools=TOOLS, tool_choice="auto", seed=1, extra_body=extra)
    choice = r.choices[0]
    assert choice.message.content == AUTO_CONTENT[parser]
    check_calls(choice.message.tool_calls, ["get_weather"])
    assert choice.finish_reason == "tool_calls"
    content, calls, finish = streamed(client, tools=TOOLS, seed=1, extra_body=extra)  # auto: the default with tools
    assert content == AUTO_CONTENT[parser] and finish == "tool_calls"
    same_calls(choice.message.tool_calls, calls)
    # without a call in the text, auto answers in plain content
    plain = create(client, tools=TOOLS, seed=1, extra_body={"guided_regex": "Fair Verona"}).choices[0]
    assert plain.message.content == "Fair Verona" and not plain.message.tool_calls and plain.finish_reason == "stop"


def test_tool_turns_in_the_history(served):
    _, client = served
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = create(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    bad = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [{**call, "function": {**call["function"], "arguments": "{"}}]},
    ]
    with pytest.raises(openai.BadRequestError, match="arguments must be JSON"):
        create(client, messages=bad, tools=TOOLS, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        create(client, messages=[*MESSAGES, {"role": "tool", "content": "x"}], max_tokens=5)


def test_tool_request_errors(served):
    _, client = served
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        create(client, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        create(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        create(client, tools=bad_schema, tool_choice="required")
    # a schema xgrammar cannot build: named by its tool and param "tools", without xgrammar's own source paths
    dangling = [{"type": "function", "function": {"name": "g", "parameters": {"$ref": "#/$defs/missing"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        create(client, tools=dangling, tool_choice="required")
    err = e.value.body
    assert err["param"] == "tools" and "the parameters of g" in err["message"]
    assert ".cc:" not in err["message"] and "/project/" not in err["message"]


def test_without_a_parser_auto_is_refused_and_required_works(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        create(client, tools=TOOLS)
    r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=3)
    check_calls(r.choices[0].message.tool_calls)


def test_the_sdk_stream_helper_reads_streamed_calls(served):
    """openai's `chat.completions.stream(...)` merges each delta's keys into the call it builds: deltas after the
    first must leave out what they do not set (a "type": null failed its assertion on every streamed call)."""
    _, client = served
    kw = dict(model="shakespeare", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    with client.chat.completions.stream(seed=1, temperature=1.0, max_tokens=300, **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    check_calls(calls)
    whole = create(client, seed=1, **{k: v for k, v in kw.items() if k not in ("model", "messages")})
    same_calls(whole.choices[0].message.tool_calls, [{"name": c.function.name, "arguments": c.function.arguments}
                                                    for c in calls])  # fmt: skip


def literal(text: str) -> str:
    """A regex that writes exactly `text` (the model made to write a given output)."""
    return re.escape(text).replace("\\\n", "\\n")


def call_text(parser: str, name: str, arguments: str, before: str = "") -> str:
    cls = TOOL_PARSERS[parser]
    return before + cls.calls_text([f'{{"name": "{name}", "{cls.arguments_key}": {arguments}}}'])


@pytest.mark.parametrize(
    "name, arguments",
    [
        ("get_stock", '{"symbol": "x"}'),  # not one of the request's tools
        ("get_weather", '{"city": "verona", "days": 9}'),  # days above its maximum
        ("get_weather", '{"city": "verona"}'),  # a required argument missing
        ("get_time", '{"zone": "EST"}'),  # not in its enum
    ],
)
def test_auto_takes_only_calls_that_fit_the_tools(served, name, arguments):
    """tool_choice auto: a call outside the request's tools, or arguments that break the tool's parameters, is
    text the model wrote (as when it writes no call), streamed or not; never a call the client would run."""
    parser, client = served
    text = call_text(parser, name, arguments, before="" if parser == "llama3_json" else "Let me look. ")
    extra = {"guided_regex": literal(text)}
    whole = create(client, tools=TOOLS, seed=1, extra_body=extra).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (text, None, "stop")
    assert streamed(client, tools=TOOLS, seed=1, extra_body=extra) == (text, [], "stop")
    # the same call to a tool that fits is a call
    fits = call_text(parser, "get_weather", '{"city": "verona", "days": 3}')
    r = create(client, tools=TOOLS, seed=1, extra_body={"guided_regex": literal(fits)}).choices[0]
    check_calls(r.message.tool_calls, ["get_weather"])


def test_auto_schema_that_cannot_check_arguments_is_refused(served):
    _, client = served
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    with pytest.raises(openai.BadRequestError, match="the parameters of f") as e:
        create(client, tools=bad)
    assert e.value.body["param"] == "tools"
    remote = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "http://127.0.0.1:9/s.json"}}}]
    with pytest.raises(openai.BadRequestError, match="the parameters of f"):
        create(client, tools=remote)


def test_malformed_and_cut_off_calls_give_one_answer_streamed_or_not(served):
    """One parser path: malformed JSON inside a call is content in both answers (a stream never sent a call it
    would have had to take back), and a forced turn cut by max_tokens keeps the same complete calls in both."""
    parser, client = served
    text = call_text(parser, "get_weather", '{"city": verona, "days": 2}', before="Let me look. ")
    extra = {"guided_regex": literal(text)}
    whole = create(client, tools=TOOLS, seed=1, extra_body=extra).choices[0]
    assert (whole.message.content, whole.message.tool_calls) == (text, None)
    assert streamed(client, tools=TOOLS, seed=1, extra_body=extra) == (text, [], "stop")
    cut_calls = []
    for max_tokens in (40, 90, 150):
        kw = dict(tools=TOOLS, tool_choice="required", seed=2, max_tokens=max_tokens)
        whole = create(client, **kw).choices[0]
        content, calls, finish = streamed(client, **kw)
        assert (whole.finish_reason, whole.message.content) == (finish, content)
        same_calls(whole.message.tool_calls or [], calls)
        if whole.message.tool_calls:
            check_calls(whole.message.tool_calls)  # never a call with half its arguments
        if finish == "length" and content:
            cut_calls.append(content)
    assert cut_calls and all('{"n' in c for c in cut_calls)  # the cut call comes back as its text
