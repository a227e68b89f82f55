"""The Qwen3-Coder (XML), pythonic (Llama 3.2 / 4) and DeepSeek-V3 tool-call formats: what a client gets from
each, whole and streamed, and that any split of the text streams to exactly what the whole-output parse gives
(the helpers are test_tool_parsers'; the JSON formats are tested there)."""

from __future__ import annotations

import functools
import json
import random

import pytest

from fulcrum.server.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    get_tool_parser,
)
from fulcrum.server.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from fulcrum.server.tool_parsers.qwen3_coder import convert_value
from tests.server.test_tool_parsers import (
    NESTED,
    NO_ARGS,
    UNICODE,
    WEATHER,
    assert_stream_matches_extract,
    splits,
    stream,
)


def tool(name: str, **properties: str) -> dict:
    props = {k: {"type": t} for k, t in properties.items()}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    tool("get_weather", city="string", unit="string"),
    tool(
        "create_event",
        title="string",
        when="object",
        attendees="array",
        flags="object",
        scores="array",
        text="string",
    ),
    tool("translate", text="string", to="string", note="string"),
    tool("get_time"),
    tool("book", nights="integer", price="number", breakfast="boolean", guests="array", note="string"),
]


# --- how each format's models write calls


def qwen_text(*calls: dict, before: str = "", after: str = "") -> str:
    def value(v):
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    blocks = [
        f"<tool_call>\n<function={c['name']}>\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in c["arguments"].items())
        + "</function>\n</tool_call>"
        for c in calls
    ]
    return before + "\n".join(blocks) + after


def pythonic_text(*calls: dict, before: str = "", after: str = "") -> str:
    inner = ", ".join(f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['arguments'].items())})" for c in calls)
    return f"{before}[{inner}]{after}"


def deepseek_text(*calls: dict, before: str = "", after: str = "", sep: str = "", ensure_ascii: bool = False) -> str:
    blocks = [
        f"{CALL_BEGIN}function{SEP}{c['name']}\n```json\n{json.dumps(c['arguments'], ensure_ascii=ensure_ascii)}\n```"
        + CALL_END
        for c in calls
    ]
    return before + CALLS_BEGIN + sep.join(blocks) + CALLS_END + after


QWEN = functools.partial(Qwen3CoderToolParser, TOOLS)  # with the request's tools: values typed by their schema
WRITERS = {Qwen3CoderToolParser: qwen_text, PythonicToolParser: pythonic_text, DeepSeekV3ToolParser: deepseek_text}
FORMATS = [Qwen3CoderToolParser, PythonicToolParser, DeepSeekV3ToolParser]
MAKERS = {
    Qwen3CoderToolParser: QWEN,
    PythonicToolParser: PythonicToolParser,
    DeepSeekV3ToolParser: DeepSeekV3ToolParser,
}


def calls_of(got) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in got.tool_calls]


def examples(cls) -> dict[str, str]:
    w = WRITERS[cls]
    cases = {
        "single": w(WEATHER),
        "parallel": w(WEATHER, NESTED, NO_ARGS),
        "nested": w(NESTED),
        "unicode": w(UNICODE),
        "content before and after": w(WEATHER, UNICODE, before="Let me look.\n", after="\nDone."),
        "plain": "The weather in Paris is mild; take a light jacket.",
        "plain with brackets": "[1] Use {curly} and [square] brackets, or <angle> ones (and parentheses).",
        "empty": "",
        "whitespace": "  \n",
        "marker-like": "a <tool and <function= and [f( and <｜tool▁calls and <|python_st done",
        "cut inside the second call": w(WEATHER, NESTED)[: w(WEATHER, NESTED).index("attendees") + 12],
    }
    return cases


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_parallel_calls_with_content_around(cls):
    # pythonic calls start the output (or follow <|python_start|>): text before a bare list makes all of it content
    before = "Let me check.<|python_start|>" if cls is PythonicToolParser else "Let me check.\n"
    text = WRITERS[cls](WEATHER, NESTED, NO_ARGS, before=before, after="\nAnything else?")
    got = MAKERS[cls]().extract(text)
    assert calls_of(got) == [
        ("get_weather", WEATHER["arguments"]),
        ("create_event", NESTED["arguments"]),
        ("get_time", {}),
    ]
    assert len({c.id for c in got.tool_calls}) == 3
    assert (
        got.content
        == before[: len("Let me check.")].rstrip()
        + ("\n" if cls is not PythonicToolParser else "")
        + "\nAnything else?"
    )
    assert_stream_matches_extract(MAKERS[cls], text)


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_unicode_arguments_as_openai_sends_them(cls):
    [call] = MAKERS[cls]().extract(WRITERS[cls](UNICODE)).tool_calls
    assert call.arguments == json.dumps(UNICODE["arguments"], ensure_ascii=False)


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_streaming_equals_extract_for_every_split(cls):
    for name, text in examples(cls).items():
        try:
            assert_stream_matches_extract(MAKERS[cls], text)
        except AssertionError as e:
            raise AssertionError(f"{name}: {text!r}") from e


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
@pytest.mark.parametrize("text", ["Paris is mild today.", "Use {curly} braces; or not.", "", " \n\t"])
def test_plain_text_is_content(cls, text):
    got = MAKERS[cls]().extract(text)
    assert got.tool_calls == [] and got.content == (text if text.strip() else None)


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_a_call_goes_out_whole_once_complete(cls):
    text = WRITERS[cls](NESTED)
    parser = MAKERS[cls]()
    pieces = list(text)
    deltas = [parser.feed(ch) for ch in pieces] + [parser.finish()]
    sent_at = [i for i, d in enumerate(deltas) if d.tool_calls]
    assert len(sent_at) == 1 and not any(d.content for d in deltas)
    [call] = deltas[sent_at[0]].tool_calls
    assert call.name == "create_event" and call.index == 0 and call.id.startswith("call_")
    assert json.loads(call.arguments) == NESTED["arguments"]


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_a_call_the_check_refuses_is_content(cls):
    def only_get_time(name: str, arguments: str) -> None:
        if name != "get_time":
            raise ValueError("not a call to take")

    text = WRITERS[cls](NO_ARGS, WEATHER)
    make = functools.partial(cls, TOOLS, only_get_time)
    got = make().extract(text)
    assert [c.name for c in got.tool_calls] == ["get_time"] and "get_weather" in got.content
    assert_stream_matches_extract(make, text)


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.name)
def test_random_garbage_never_raises(cls):
    rng = random.Random(11)
    pieces = [*"{}[]()\"':,;= \n\\0123456789-.<>/_|abnlrstfx`", "é", "🎉", "True", "None", '"""', "'''"]
    pieces += ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "</parameter>"]
    pieces += ["<|python_start|>", "<|python_end|>", "f(", "get_time()", "[", "]"]
    pieces += [CALLS_BEGIN, CALL_BEGIN, "function" + SEP, "f\n```json\n", "\n```", CALL_END, CALLS_END]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        want = cls().extract(text)
        for call in want.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)
        content, calls = stream(cls(), splits(text, rng))
        assert content == (want.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want.tool_calls]


def test_registry_and_cli():
    assert {"qwen3_coder", "pythonic", "deepseek_v3"} <= set(TOOL_PARSERS)
    for name in ("qwen3_coder", "pythonic", "deepseek_v3"):
        assert type(get_tool_parser(name, tools=TOOLS)) is TOOL_PARSERS[name] and TOOL_PARSERS[name].name == name
    from fulcrum.cli import build_parser

    for name in ("qwen3_coder", "pythonic", "deepseek_v3"):
        assert build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name


def test_qwen3_coder_reads_the_forced_call_text():
    # a grammar forcing calls (tools.ToolCalling.grammar) writes the parser's call_prefix, a JSON call object and
    # call_suffix: for Qwen3-Coder that is Hermes' form, which it reads as well
    objs = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "get_time", "arguments": {}}']
    text = Qwen3CoderToolParser.calls_text(objs)
    got = QWEN().extract(text)
    assert got.content is None and calls_of(got) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert_stream_matches_extract(QWEN, text)


# --- Qwen3-Coder


def test_qwen3_coder_real_output():
    # as Qwen3-Coder writes it (its chat template's own layout), a code-editing call among them
    text = (
        "I'll write the file and then run it.\n"
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
        '<parameter=content>\ndef main():\n    print("hi <b>")\n\n\nif __name__ == "__main__":\n    main()\n\n'
        "</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=run>\n<parameter=command>\npython src/main.py\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
    )
    tools = [tool("write_file", path="string", content="string"), tool("run", command="string", timeout="integer")]
    got = Qwen3CoderToolParser(tools).extract(text)
    assert got.content == "I'll write the file and then run it.\n"
    assert calls_of(got) == [
        (
            "write_file",
            {
                "path": "src/main.py",
                "content": 'def main():\n    print("hi <b>")\n\n\nif __name__ == "__main__":\n    main()\n',
            },
        ),
        ("run", {"command": "python src/main.py", "timeout": 30}),
    ]
    assert_stream_matches_extract(functools.partial(Qwen3CoderToolParser, tools), text)


def test_qwen3_coder_values_take_their_schema_types():
    text = qwen_text(
        {
            "name": "book",
            "arguments": {"nights": "3", "price": "99.5", "breakfast": "True", "guests": "['Ann', 'Bo']", "note": "42"},
        }
    )
    got = Qwen3CoderToolParser(TOOLS).extract(text)
    assert calls_of(got) == [
        ("book", {"nights": 3, "price": 99.5, "breakfast": True, "guests": ["Ann", "Bo"], "note": "42"})
    ]
    # without the tools, what reads as JSON is JSON and the rest text
    untyped = Qwen3CoderToolParser().extract(text)
    assert calls_of(untyped) == [
        ("book", {"nights": 3, "price": 99.5, "breakfast": "True", "guests": "['Ann', 'Bo']", "note": 42})
    ]


@pytest.mark.parametrize(
    "text, schema, value",
    [
        ("Paris", {"type": "string"}, "Paris"),
        ("  spaced  ", {"type": "string"}, "  spaced  "),
        ("null", {"type": "string"}, "null"),
        ("null", {"type": ["string", "null"]}, None),
        ("null", {"type": "integer"}, None),
        ("7", {"type": "integer"}, 7),
        ("7.0", {"type": "integer"}, 7),
        ("-2.5e3", {"type": "number"}, -2500.0),
        ("false", {"type": "boolean"}, False),
        ("TRUE", {"type": "boolean"}, True),
        ('{"a": {"b": [1, null]}}', {"type": "object"}, {"a": {"b": [1, None]}}),
        ("{'a': True}", {"type": "object"}, {"a": True}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
        ("five", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "five"),
        ("red", {"enum": ["red", "green"]}, "red"),
        ("NaN", {"type": "number"}, "NaN"),  # no JSON number: left as text for the check to refuse
        ("abc", {"type": "integer"}, "abc"),
        ('"quoted"', None, "quoted"),
        ("[1, 2]", None, [1, 2]),
        ("plain words", None, "plain words"),
    ],
)
def test_qwen3_coder_convert_value(text, schema, value):
    got = convert_value(text, schema)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        # a missing </tool_call> at the end is forgiven; a missing </parameter> before </function> too
        ("<tool_call>\n<function=get_time>\n</function>", None, [("get_time", {})]),
        (
            "<tool_call><function=get_weather><parameter=city>Paris</function></tool_call>",
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        # two functions in one <tool_call>
        (
            "<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n</tool_call>",
            None,
            [("get_time", {}), ("get_weather", {"city": "Oslo"})],
        ),
        # the Hermes JSON form inside <tool_call> (what a grammar forcing calls writes)
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        # a value keeps its inner line breaks and markup
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nSão <i>Paulo</i>\n\n</parameter>\n</function>\n</tool_call>",
            None,
            [("get_weather", {"city": "\nSão <i>Paulo</i>\n"})],
        ),
    ],
)
def test_qwen3_coder_variants(text, content, calls):
    got = QWEN().extract(text)
    assert (got.content, calls_of(got)) == (content, calls)
    assert_stream_matches_extract(QWEN, text)


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=city>\nRome\n</parameter>\n</function>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<func=get_time>\n</func>\n</tool_call>",
        "<tool_call>\n<function=get weather\n>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut off
        "<tool_call>\n",
    ],
)
def test_qwen3_coder_malformed_is_content(bad):
    first = qwen_text(NO_ARGS)
    text = first + "\n" + bad
    got = QWEN().extract(text)
    assert calls_of(got) == [("get_time", {})] and got.content == "\n" + bad
    assert_stream_matches_extract(QWEN, text)
    assert QWEN().extract(bad).content == bad


def test_qwen3_coder_no_piece_of_a_marker_is_sent_as_content():
    parser = QWEN()
    assert "".join(parser.feed(ch).content or "" for ch in "Sure. " + qwen_text(WEATHER)) == "Sure. "
    parser = QWEN()
    assert parser.feed("x <tool_cal").content == "x "
    assert parser.feed("!").content == "<tool_cal!"


# --- pythonic


def test_pythonic_real_outputs():
    # Llama 3.2 writes the bare list; Llama 4 wraps it in <|python_start|> ... <|python_end|>
    llama32 = '[get_weather(city="San Francisco", metric=True), get_time(timezone=None)]'
    llama4 = "<|python_start|>" + llama32 + "<|python_end|>"
    for text in (llama32, llama4, llama4 + "\n", "\n " + llama32):
        got = PythonicToolParser().extract(text)
        assert got.content is None
        assert calls_of(got) == [
            ("get_weather", {"city": "San Francisco", "metric": True}),
            ("get_time", {"timezone": None}),
        ]
        assert_stream_matches_extract(PythonicToolParser, text)


@pytest.mark.parametrize(
    "text, arguments",
    [
        ("[f(s='it\\'s', t=\"a\\\"b\\\\c\\n\")]", {"s": "it's", "t": 'a"b\\c\n'}),
        ("[f(s='caf\\u00e9 \\N{SNOWMAN}', t='日本 🎉')]", {"s": "café ☃", "t": "日本 🎉"}),
        (
            '[f(s="""multi\nline "quoted" (paren]""", e=\'\', d="")]',
            {"s": 'multi\nline "quoted" (paren]', "e": "", "d": ""},
        ),
        (
            "[f(n=-3, x=2.5e-3, big=12345678901234567890, t=(1, 2), l=[], d={})]",
            {"n": -3, "x": 0.0025, "big": 12345678901234567890, "t": [1, 2], "l": [], "d": {}},
        ),
        ("[f(d={'a': {'b': [True, False, None]}, 'k': 'v'})]", {"d": {"a": {"b": [True, False, None]}, "k": "v"}}),
        ("[ f( a = 1 ,b=2, ) ]", {"a": 1, "b": 2}),
    ],
)
def test_pythonic_literals(text, arguments):
    got = PythonicToolParser().extract(text)
    assert got.content is None and calls_of(got) == [("f", arguments)]
    assert_stream_matches_extract(PythonicToolParser, text)


@pytest.mark.parametrize(
    "bad",
    [
        "g(1, 2)",  # positional
        "g(**kw)",
        "g(a=1, a=2)",
        "g(a=x)",  # a name, not a literal
        "g(a=__import__('os').system('echo hi'))",  # never evaluated
        "g(a=1 + 2j)",
        "g(a={1, 2})",
        "g(a={1: 'x'})",
        "g(a=b'x')",
        "g(a=f'{x}')",
        "g(a=float('nan'))",
        "os.system(cmd='ls')",
        "g(a='unclosed)",
        "g(a=1",  # cut off
        "g(a=[1, 2)]",
        "g",
        "3(a=1)",
    ],
)
def test_pythonic_malformed_is_content(bad):
    text = f"[get_time(), {bad}]"
    got = PythonicToolParser().extract(text)
    assert calls_of(got) == [("get_time", {})] and got.content == f", {bad}]"
    assert_stream_matches_extract(PythonicToolParser, text)
    alone = f"[{bad}]"
    assert PythonicToolParser().extract(alone).content == alone


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("[Note] see below", "[Note] see below", []),
        ("Sure: [get_time()]", "Sure: [get_time()]", []),  # calls start the output, or follow <|python_start|>
        ("Sure: <|python_start|>[get_time()]<|python_end|> done", "Sure:  done", [("get_time", {})]),
        ("[get_time()] and that is all", " and that is all", [("get_time", {})]),
        ("[get_time()", None, [("get_time", {})]),  # the list never closed: its complete calls stand
        ("[]", "[]", []),
        ("<|python_start|>oops", "<|python_start|>oops", []),
    ],
)
def test_pythonic_variants(text, content, calls):
    got = PythonicToolParser().extract(text)
    assert (got.content, calls_of(got)) == (content, calls)
    assert_stream_matches_extract(PythonicToolParser, text)


def test_pythonic_streams_each_call_when_its_parenthesis_closes():
    parser = PythonicToolParser()
    text = '[get_weather(city="Paris (FR)"), get_time()]'
    first = text.index(")", text.index("FR)") + 3) + 1
    assert not parser.feed(text[: first - 1]).tool_calls
    assert [c.name for c in parser.feed(text[first - 1]).tool_calls] == ["get_weather"]
    assert [c.name for c in parser.feed(text[first:]).tool_calls] == ["get_time"]


# --- DeepSeek-V3


def test_deepseek_v3_real_output():
    # as DeepSeek-V3 writes it (its chat template's layout: calls one per line inside the block)
    text = (
        "I'll check both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n"
        '```json\n{"location": "Tokyo"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n"
        '```json\n{"location": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    assert CALLS_BEGIN == "<\uff5ctool\u2581calls\u2581begin\uff5c>" and SEP == "<\uff5ctool\u2581sep\uff5c>"
    got = DeepSeekV3ToolParser().extract(text)
    assert got.content == "I'll check both."
    assert calls_of(got) == [
        ("get_current_weather", {"location": "Tokyo"}),
        ("get_current_weather", {"location": "Paris", "unit": "celsius"}),
    ]
    assert_stream_matches_extract(DeepSeekV3ToolParser, text)


def test_deepseek_v3_escaped_unicode_and_newline_separated():
    text = deepseek_text(UNICODE, NESTED, sep="\n", ensure_ascii=True)
    got = DeepSeekV3ToolParser().extract(text)
    assert got.tool_calls[0].arguments == json.dumps(UNICODE["arguments"], ensure_ascii=False)
    assert calls_of(got)[1] == ("create_event", NESTED["arguments"])
    assert_stream_matches_extract(DeepSeekV3ToolParser, text)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (deepseek_text(WEATHER)[: -len(CALLS_END)], None, [("get_weather", WEATHER["arguments"])]),  # no end marker
        (deepseek_text(WEATHER)[: -len(CALL_END + CALLS_END) - 4], None, [("get_weather", WEATHER["arguments"])]),
        (
            deepseek_text(WEATHER) + CALLS_BEGIN + deepseek_text(NO_ARGS)[len(CALLS_BEGIN) :],
            None,
            [("get_weather", WEATHER["arguments"]), ("get_time", {})],
        ),
        (CALLS_BEGIN + CALLS_END, CALLS_BEGIN + CALLS_END, []),
        (CALLS_BEGIN, CALLS_BEGIN, []),
        ("see <｜tool▁calls▁begin", "see <｜tool▁calls▁begin", []),
    ],
)
def test_deepseek_v3_variants(text, content, calls):
    got = DeepSeekV3ToolParser().extract(text)
    assert (got.content, calls_of(got)) == (content, calls)
    assert_stream_matches_extract(DeepSeekV3ToolParser, text)


@pytest.mark.parametrize(
    "bad",
    [
        f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris",}}\n```{CALL_END}',
        f"{CALL_BEGIN}function{SEP}get_weather\n```json\n[1]\n```{CALL_END}",
        f'{CALL_BEGIN}function{SEP}get_weather\n{{"city": "Paris"}}{CALL_END}',  # no fence
        f"{CALL_BEGIN}tool{SEP}get_weather\n```json\n{{}}\n```{CALL_END}",
        f"{CALL_BEGIN}function{SEP}\n```json\n{{}}\n```{CALL_END}",
        f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Par',  # cut off
        f"{CALL_BEGIN}function{SEP}get_weather```json\n{{}}\n```{CALL_END}",
    ],
)
def test_deepseek_v3_malformed_is_content(bad):
    first = deepseek_text(NO_ARGS)[: -len(CALLS_END)]
    text = first + bad + CALLS_END
    got = DeepSeekV3ToolParser().extract(text)
    assert calls_of(got) == [("get_time", {})] and got.content == bad + CALLS_END
    assert_stream_matches_extract(DeepSeekV3ToolParser, text)
    alone = CALLS_BEGIN + bad + CALLS_END
    assert DeepSeekV3ToolParser().extract(alone).content == alone
