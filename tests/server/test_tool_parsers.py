"""Tool-call parsers: what a client of /v1/chat/completions gets from each format's output, whole and
streamed, and that streaming (any split of the text, malformed or cut-off output included) ends with exactly
what the whole-output parse gives."""

from __future__ import annotations

import json
import random
import re

import pytest

from fulcrum.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolParser,
    get_tool_parser,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
NESTED = {
    "name": "create_event",
    "arguments": {
        "title": "Review",
        "when": {"start": {"date": "2025-01-02", "time": "10:00"}, "duration_min": 30},
        "attendees": [{"name": "Ann", "tags": ["a", "b"]}, {"name": "Bo", "tags": []}],
        "flags": {"urgent": True, "remind": False, "room": None},
        "scores": [-1, 0, 2.5, 1e-3, -0.0],
        "text": 'a "quoted" back\\slash\nnew line \u00e9 {not a brace} [x]',
    },
}
UNICODE = {"name": "translate", "arguments": {"text": "日本語のテキスト 🎉", "to": "Ελληνικά", "note": "naïve café"}}
NO_ARGS = {"name": "get_time", "arguments": {}}


def obj_text(call: dict, parser: type[ToolParser], **dumps) -> str:
    """A call object as the model writes it, with the format's arguments key."""
    return json.dumps({"name": call["name"], parser.arguments_key: call["arguments"]}, **dumps)


def output(parser: type[ToolParser], *calls: dict, before: str = "") -> str:
    return before + parser.calls_text([obj_text(c, parser, ensure_ascii=False) for c in calls])


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict]]:
    """What a streaming client assembles: the content, and per index the call's id, name and arguments."""
    content, calls = "", []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content or ""
        for tc in delta.tool_calls:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.name
                calls.append({"id": tc.id, "name": tc.name, "arguments": ""})
            else:
                assert tc.name is None and tc.index == len(calls) - 1
            calls[tc.index]["arguments"] += tc.arguments
    return content, calls


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def assert_stream_matches_extract(cls: type[ToolParser], text: str) -> None:
    want = cls().extract(text)
    rng = random.Random(1234)
    for pieces in [list(text), [text], *(splits(text, rng) for _ in range(25))]:
        content, calls = stream(cls(), pieces)
        assert content == (want.content or ""), pieces
        assert [c["name"] for c in calls] == [c.name for c in want.tool_calls], pieces
        for got, expected in zip(calls, want.tool_calls):
            assert json.loads(got["arguments"]) == json.loads(expected.arguments), pieces


FORMATS = [HermesToolParser, Llama3JsonToolParser, MistralToolParser]


def examples(cls: type[ToolParser]) -> dict[str, str]:
    """Outputs of each kind, written the way the format's models write them."""
    cases = {
        "single": output(cls, WEATHER),
        "parallel": output(cls, WEATHER, NESTED, NO_ARGS),
        "nested": output(cls, NESTED),
        "unicode": output(cls, UNICODE),
        "unicode escaped": cls.calls_text([obj_text(UNICODE, cls)]),
        "compact": cls.calls_text([obj_text(WEATHER, cls, separators=(",", ":"))]),
        "plain": "The weather in Paris is mild; take a light jacket.",
        "plain with braces": "Use {curly} and [square] brackets, or <angle> ones.",
        "empty": "",
        "whitespace": "  \n",
        "malformed": cls.calls_text(['{"name": "get_weather" "arguments": {"city": "Paris"}}']),
        "malformed name": cls.calls_text(['{"name": get_weather, "arguments": {"city": "Paris"}}']),
        "name not a string": cls.calls_text(['{"name": 3, "arguments": {}}']),
        "no arguments": cls.calls_text(['{"name": "get_time"}']),
        "not an object": cls.calls_text(['["get_time", {}]']),
        "malformed after a call": cls.calls_text([obj_text(WEATHER, cls), '{"name": "get_time", "arguments": {']),
        "cut inside the second call": output(cls, WEATHER, NESTED)[: output(cls, WEATHER, NESTED).index("attendees")],
    }
    if cls is not Llama3JsonToolParser:  # Llama's calls are the whole output: no content beside them
        cases["content before"] = output(cls, WEATHER, before="Let me look that up.\n")
        cases["content before, parallel"] = output(cls, WEATHER, UNICODE, before="Two lookups: ")
        cases["marker-like text"] = "a <tool and [TOOL and <tool_call and [TOOL_CALLS and done"
    return cases


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_single_call(cls):
    got = cls().extract(output(cls, WEATHER))
    assert got.content is None
    [call] = got.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == WEATHER["arguments"]


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_parallel_calls_keep_their_order(cls):
    got = cls().extract(output(cls, WEATHER, NESTED, NO_ARGS))
    assert [c.name for c in got.tool_calls] == ["get_weather", "create_event", "get_time"]
    assert [json.loads(c.arguments) for c in got.tool_calls] == [
        WEATHER["arguments"],
        NESTED["arguments"],
        {},
    ]
    assert len({c.id for c in got.tool_calls}) == 3
    assert got.content is None


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_nested_and_unicode_arguments_as_openai_sends_them(cls):
    nested, uni = cls().extract(output(cls, NESTED, UNICODE)).tool_calls
    assert json.loads(nested.arguments) == NESTED["arguments"]
    # compact JSON with the characters themselves, not \u escapes, even when the model escaped them
    assert uni.arguments == json.dumps(UNICODE["arguments"], ensure_ascii=False)
    escaped = cls().extract(cls.calls_text([obj_text(UNICODE, cls)])).tool_calls[0]
    assert escaped.arguments == uni.arguments


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
@pytest.mark.parametrize("text", ["Paris is mild today.", "Use {curly} braces; or not.", "", " \n\t"])
def test_plain_text_is_content(cls, text):
    got = cls().extract(text)
    assert got.tool_calls == []
    assert got.content == (text if text.strip() else None)


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "obj",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris",}}',  # trailing comma
        '{"name": "get_weather", "arguments": {"city": Paris}}',  # bare word
        '{"name": "get_weather", "arguments": {"x": NaN}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "get_time"}',
        '{"arguments": {}}',
        '{"name": "a", "name": "b", "arguments": {}}',
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut off
        "not json at all",
    ],
)
def test_a_malformed_call_and_what_follows_are_content(cls, obj):
    # the complete call before it stays a call; the text from the malformed one on is the client's to read
    text = cls.calls_text([obj_text(WEATHER, cls), obj])
    got = cls().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", WEATHER["arguments"])]
    assert text.endswith(got.content) and obj in got.content
    assert_stream_matches_extract(cls, text)
    alone = cls.calls_text([obj])
    assert cls().extract(alone) == type(got)(content=alone, tool_calls=[])


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_streaming_equals_extract_for_every_split(cls):
    for name, text in examples(cls).items():
        try:
            assert_stream_matches_extract(cls, text)
        except AssertionError as e:
            raise AssertionError(f"{name}: {text!r}") from e


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_call_ids(cls):
    ids = [c.id for c in cls().extract(output(cls, WEATHER, NO_ARGS)).tool_calls]
    pattern = r"[A-Za-z0-9]{9}" if cls is MistralToolParser else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(pattern, i) for i in ids)
    assert ids[0] != ids[1]


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_a_call_goes_out_whole_once_complete(cls):
    # nothing of a call is sent before its object closes (a later fault would have to take it back), then all
    # of it in one delta: id, name and compact arguments
    text = output(cls, NESTED)
    end = text.rindex("}") + 1
    parser = cls()
    before = [parser.feed(ch) for ch in text[: end - 1]]
    assert not any(d.tool_calls or d.content for d in before)
    [call] = parser.feed(text[end - 1 :]).tool_calls + parser.finish().tool_calls
    assert call.name == "create_event" and call.id and call.index == 0
    assert call.arguments == json.dumps(NESTED["arguments"], ensure_ascii=False)


def test_hermes_real_output():
    # Qwen2.5 / Qwen3 write exactly this (the chat template's own example)
    text = (
        "I'll check both cities.\n<tool_call>\n"
        '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_current_temperature", "arguments": {"location": "東京", "unit": "celsius"}}\n'
        "</tool_call>"
    )
    got = HermesToolParser().extract(text)
    assert got.content == "I'll check both cities.\n"
    assert [json.loads(c.arguments) for c in got.tool_calls] == [
        {"location": "San Francisco, CA, USA"},
        {"location": "東京", "unit": "celsius"},
    ]
    assert_stream_matches_extract(HermesToolParser, text)


@pytest.mark.parametrize(
    "text",
    [
        # Hermes 2 Pro sometimes writes the arguments first
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        # the output ended before </tool_call> (vLLM keeps such a call)
        '<tool_call>\n{"name": "get_stock_fundamentals", "arguments": {"symbol": "TSLA"}}',
        '<tool_call>{"name":"get_stock_fundamentals","arguments":{"symbol":"TSLA"}}</tool_call>',
        # arguments encoded twice, as a JSON string
        '<tool_call>\n{"name": "get_stock_fundamentals", "arguments": "{\\"symbol\\": \\"TSLA\\"}"}\n</tool_call>',
        # extra keys are ignored
        '<tool_call>\n{"type": "function", "name": "get_stock_fundamentals", "id": 7, '
        '"arguments": {"symbol": "TSLA"}}\n</tool_call>',
    ],
)
def test_hermes_variants(text):
    [call] = HermesToolParser().extract(text).tool_calls
    assert call.name == "get_stock_fundamentals"
    assert json.loads(call.arguments) == {"symbol": "TSLA"}
    assert_stream_matches_extract(HermesToolParser, text)


def test_hermes_text_after_and_between_calls():
    text = f"Checking.\n{HermesToolParser.calls_text([obj_text(WEATHER, HermesToolParser)])}\n\nDone: see above.\n"
    got = HermesToolParser().extract(text)
    assert got.content == "Checking.\n\n\nDone: see above.\n"
    assert len(got.tool_calls) == 1
    assert_stream_matches_extract(HermesToolParser, text)


@pytest.mark.parametrize(
    "text",
    [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        '\n{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}\n',
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}};',
    ],
)
def test_llama3_variants(text):
    got = Llama3JsonToolParser().extract(text)
    assert got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", WEATHER["arguments"])]
    assert_stream_matches_extract(Llama3JsonToolParser, text)


@pytest.mark.parametrize(
    "text",
    [
        '{"answer": 42}',  # JSON content, not a call
        '{"name": "Bob", "age": 41}',
        '<|python_tag|>brave_search.call(query="weather Paris")',  # the built-in tools' Python form
        '{"name": "a", "parameters": {}, "arguments": {}}',
        "<|python_ta",
    ],
)
def test_llama3_not_calls_is_content(text):
    got = Llama3JsonToolParser().extract(text)
    assert got == type(got)(content=text, tool_calls=[])
    assert_stream_matches_extract(Llama3JsonToolParser, text)


def test_llama3_words_after_a_call_are_content():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some words'
    got = Llama3JsonToolParser().extract(text)
    assert [c.name for c in got.tool_calls] == ["get_weather"] and got.content == " and then some words"
    assert_stream_matches_extract(Llama3JsonToolParser, text)


def test_mistral_real_output():
    text = (
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}, {"name": "get_current_weather", "arguments": {"location": "Kraków"}}]'
    )
    got = MistralToolParser().extract(text)
    assert got.content is None
    assert [json.loads(c.arguments)["location"] for c in got.tool_calls] == ["Paris, France", "Kraków"]
    assert_stream_matches_extract(MistralToolParser, text)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", 0),
        ('Ok.[TOOL_CALLS][{"name": "f", "arguments": {}}] Anything else?', "Ok. Anything else?", 1),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}][TOOL_CALLS][{"name": "g", "arguments": {}}]', None, 2),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}', None, 1),  # the array never closed
    ],
)
def test_mistral_variants(text, content, calls):
    got = MistralToolParser().extract(text)
    assert (got.content, len(got.tool_calls)) == (content, calls)
    assert_stream_matches_extract(MistralToolParser, text)


@pytest.mark.parametrize(
    "cls, marker", [(HermesToolParser, "<tool_call>"), (MistralToolParser, "[TOOL_CALLS]")], ids=["hermes", "mistral"]
)
def test_no_piece_of_a_marker_is_sent_as_content(cls, marker):
    parser = cls()
    text = "Sure. " + cls.calls_text([obj_text(WEATHER, cls)])
    sent = "".join(parser.feed(ch).content or "" for ch in text)
    assert sent == "Sure. "
    # text that only looked like the start of a marker goes out once it cannot be one
    parser = cls()
    assert parser.feed("x " + marker[:-1]).content == "x "
    assert parser.feed("!").content == marker[:-1] + "!"
    parser = cls()
    parser.feed("x " + marker[:5])
    assert parser.finish().content == marker[:5]


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_output_cut_inside_arguments(cls):
    # max_tokens hit inside the second call's arguments: the first call stands, the cut one is text, streamed
    # or not (a stream never sent any of it as a call)
    text = output(cls, WEATHER, NESTED)
    text = text[: text.index("attendees")]
    got = cls().extract(text)
    assert [c.name for c in got.tool_calls] == ["get_weather"]
    assert got.content.lstrip(" ,;\n").startswith(cls.call_prefix + '{"name": "create_event"')
    content, calls = stream(cls(), list(text))
    assert [c["name"] for c in calls] == ["get_weather"] and content == got.content


def test_garbage_after_a_streamed_call_is_content():
    text = output(Llama3JsonToolParser, WEATHER) + " <|eot_id|> and more"
    content, calls = stream(Llama3JsonToolParser(), list(text))
    assert [c["name"] for c in calls] == ["get_weather"]
    assert content == " <|eot_id|> and more"


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_random_garbage_never_raises(cls):
    rng = random.Random(7)
    pieces = [*'{}[]":,; \n\\u0123456789-.eE<>/_|abnlrst', "<tool_call>", "</tool_call>", "[TOOL_CALLS]"]
    pieces += ["<|python_tag|>", '"name"', '"arguments"', '"parameters"', '"f"', "é", "🎉"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 50)))
        want = cls().extract(text)
        for call in want.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)
        content, calls = stream(cls(), splits(text, rng))
        assert content == (want.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want.tool_calls]


def test_registry_and_unknown_name():
    assert set(TOOL_PARSERS) == {"deepseek_v3", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"}
    for name, cls in TOOL_PARSERS.items():
        parser = get_tool_parser(name, tools=[{"type": "function", "function": {"name": "get_weather"}}])
        assert isinstance(parser, cls) and parser.name == name
    with pytest.raises(ValueError, match="known: deepseek_v3, hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        get_tool_parser("qwen")


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_a_call_the_check_refuses_is_content(cls):
    def only_get_time(name: str, arguments: str) -> None:
        if name != "get_time" or json.loads(arguments):
            raise ValueError("not a call to take")

    text = output(cls, NO_ARGS, WEATHER)
    got = cls(check=only_get_time).extract(text)
    assert [c.name for c in got.tool_calls] == ["get_time"] and '"get_weather"' in got.content
    rng = random.Random(3)
    for pieces in [list(text), splits(text, rng)]:
        content, calls = stream(cls(check=only_get_time), pieces)
        assert content == got.content and [c["name"] for c in calls] == ["get_time"]
    assert [c.name for c in cls().extract(text).tool_calls] == ["get_time", "get_weather"]  # no check: any call


def test_grammar_pieces():
    # what the integrator's grammar for forced calls writes around each call object
    h, ll, m = HermesToolParser, Llama3JsonToolParser, MistralToolParser
    assert (h.calls_prefix, h.call_prefix, h.call_suffix, h.call_separator, h.calls_suffix, h.arguments_key) == (
        "",
        "<tool_call>\n",
        "\n</tool_call>",
        "\n",
        "",
        "arguments",
    )
    assert (ll.call_prefix, ll.call_suffix, ll.call_separator, ll.arguments_key) == ("", "", "; ", "parameters")
    assert (m.calls_prefix, m.call_prefix, m.call_suffix, m.call_separator, m.calls_suffix) == (
        "[TOOL_CALLS][",
        "",
        "",
        ", ",
        "]",
    )
    assert m.calls_text(["{A}", "{B}"]) == "[TOOL_CALLS][{A}, {B}]"
    assert h.calls_text(["{A}", "{B}"]) == "<tool_call>\n{A}\n</tool_call>\n<tool_call>\n{B}\n</tool_call>"
