"""Property-based fuzzing of the completions and chat endpoints over raw HTTP, straight and through the router:
whatever a client sends (sampling fields, grammars of every kind and hostile JSON schemas, tools and tool
choices), the answer is a 200 with a valid body or a 4xx in OpenAI's shape, never a 5xx; afterwards the engine
is alive, holds no request and no KV block, and gives the same greedy text as before."""

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulcrum.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ErrorResponse
from tests.router.conftest import router_process
from tests.server.test_http_errors import metric
from tests.servers import start_server

BIG = [2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
JUNK = st.sampled_from([None, True, False, "", "x", [], {}, [None], {"a": 1}, float("nan"), float("inf"), -1.5])
BAD_INT = st.one_of(st.sampled_from(BIG), st.integers(-(2**70), 2**70), JUNK)
BAD_FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-50, 1e300, -1e-9]), JUNK)

text = st.text(st.characters(codec="utf-8"), max_size=40)
bad_text = st.sampled_from(["", "\ud800", "a\udfff"]) | JUNK
token_ids = st.lists(st.integers(0, 2047), min_size=1, max_size=12)
bad_token_ids = (
    st.lists(st.integers(-5, 2100) | st.sampled_from([2048, 999999, -99999, True, 2**64, 1.5]), max_size=12) | JUNK
)

# each field: (values a client may send, values it must be refused for)
SAMPLING = {
    "temperature": (st.floats(0, 2), BAD_FLOAT),
    "top_p": (st.floats(1e-6, 1), BAD_FLOAT),
    # the vocabulary (2048 for the bundled model) is the edge that matters: values around and past it
    "top_k": (st.integers(-1, 50) | st.sampled_from([2047, 2048, 2049, 5000, 2**62]), BAD_INT),
    "min_p": (st.floats(0, 1), BAD_FLOAT),
    "n": (st.integers(1, 3), BAD_INT),
    "seed": (st.integers(-(2**63), 2**63 - 3), BAD_INT),
    "presence_penalty": (st.floats(-2, 2), BAD_FLOAT),
    "frequency_penalty": (st.floats(-2, 2), BAD_FLOAT),
    "repetition_penalty": (st.floats(0.01, 3), BAD_FLOAT),
    "stop": (text.filter(bool) | st.lists(text.filter(bool), max_size=3), bad_text),
    "stop_token_ids": (st.lists(st.integers(0, 2047), max_size=5), bad_token_ids),
    "min_tokens": (st.integers(0, 2), BAD_INT),  # with stop_token_ids, min_tokens masks them: both are drawn
    "ignore_eos": (st.booleans(), JUNK),
    "priority": (st.integers(-(2**63), 2**63 - 1), BAD_INT),
    "logit_bias": (
        st.dictionaries(st.integers(0, 2047).map(str), st.floats(-100, 100), max_size=3),
        st.dictionaries(st.sampled_from(["2048", "-1", "x", "1.5"]), st.floats(-100, 100), min_size=1) | JUNK,
    ),
    "stream": (st.booleans(), JUNK),
    "stream_options": (
        st.sampled_from([None, {"include_usage": True}]),
        st.sampled_from(["yes", {"include_usage": []}]),
    ),
    "skip_special_tokens": (st.booleans(), JUNK),
    "model": (st.just("shakespeare"), st.sampled_from(["gpt-4", "", "\ud800"]) | JUNK),
    "some_extension": (JUNK, JUNK),
}
# Structured output: schemas drawn from what xgrammar enforces, and hostile ones (each must be refused or
# enforced: look-ahead patterns, required names never defined, remote $refs, negative bounds, keywords that would
# pass silently, a schema 300 deep, one whose compile needs gigabytes for 57 KB of text)
LEAF_SCHEMAS = [
    {"type": "string", "maxLength": 8},
    {"type": "string", "pattern": "[a-z]{1,4}"},
    {"type": "integer", "minimum": 0, "maximum": 99},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["Montague", "Capulet", 3]},
    {"const": "Verona"},
    {"type": "string", "format": "date"},
]


def _object(props: dict, draw_required: list) -> dict:
    return {"type": "object", "properties": props, "required": draw_required}


schemas = st.recursive(
    st.sampled_from(LEAF_SCHEMAS),
    lambda kids: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "name", "x y"]), kids, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(lambda req: _object(props, req))
        ),
        st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, kids, st.integers(0, 3)),
        st.lists(kids, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
    ),
    max_leaves=6,
)
object_schemas = schemas.filter(lambda s: s.get("type") == "object") | st.just({"type": "object", "properties": {}})


def _deep(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE_SCHEMAS = [
    {"type": "string", "pattern": "(?=a)[a-z]+"},
    {"type": "string", "pattern": "(a)\\1"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": False},
    {"$ref": "http://127.0.0.1:9/schema.json"},
    {"$ref": "file:///etc/passwd"},
    {"$ref": "#/$defs/missing"},
    {"type": "string", "maxLength": -1},
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "array", "uniqueItems": True},
    {"allOf": [{"type": "integer"}]},
    {"type": "strin"},
    {"enum": "Montague"},
    {"type": "integer", "multipleOf": 0},
    _deep(300),
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}},
    "a string",
    3,
    [],
]
hostile_schemas = st.sampled_from(HOSTILE_SCHEMAS) | JUNK
json_schema_format = st.builds(
    lambda schema: {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}, schemas
)
STRUCTURED = {
    "response_format": (
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | json_schema_format,
        st.builds(
            lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, hostile_schemas
        )
        | st.sampled_from([{"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": 3}])
        | JUNK,
    ),
    "guided_json": (schemas, hostile_schemas),
    "guided_regex": (
        st.sampled_from(["[a-z]{1,5}", "(yes|no)", "[0-9]+(\\.[0-9]+)?", "ROMEO|JULIET"]),
        st.sampled_from(["(?=a)b", "(", "a{99999999}", "(a)\\1", "[z-a]"]) | JUNK,
    ),
    "guided_choice": (st.lists(text.filter(bool), min_size=1, max_size=3), st.just([]) | JUNK),
    "guided_grammar": (
        st.sampled_from(['root ::= "hail" | "good morrow"', 'root ::= [a-z]+ " " [0-9]']),
        st.sampled_from(["root ::=", "root ::= undefined_rule", 'x ::= "a"']) | JUNK,
    ),
}
tool = st.builds(
    lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
    st.sampled_from(["get_weather", "get_time", "f"]),
    object_schemas,
)
TOOLS = {
    "tools": (
        st.lists(tool, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
        st.lists(
            st.builds(
                lambda params: {"type": "function", "function": {"name": "bad", "parameters": params}},
                hostile_schemas,
            ),
            min_size=1,
            max_size=1,
        )
        | st.sampled_from([[{"type": "function"}], [{"type": "code", "function": {"name": "f"}}], [3]])
        | JUNK,
    ),
    "tool_choice": (
        st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]),
        st.sampled_from(["always", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}]) | JUNK,
    ),
    "parallel_tool_calls": (st.booleans(), JUNK),
}
# small outputs keep each example fast; the invalid ones are refused before any work
MAX_TOKENS = (st.integers(1, 8), st.sampled_from([0, -1, 5000, 2**64, True, "4", 2.5]))
COMPLETIONS = {
    "prompt": (
        text.filter(bool)
        | st.lists(text.filter(bool), min_size=1, max_size=3)
        | token_ids
        | st.lists(token_ids, min_size=1, max_size=2),
        bad_text | st.lists(bad_text, max_size=3) | bad_token_ids | st.lists(bad_token_ids, max_size=2),
    ),
    "max_tokens": MAX_TOKENS,
    "echo": (st.booleans(), JUNK),
    "logprobs": (st.integers(0, 3), BAD_INT),
    "best_of": (st.none(), BAD_INT),
}
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
    }
)
# image parts: the bundled model reads no images, and each of these is malformed besides
bad_image_part = st.sampled_from(
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!not base64!!"}},
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
        {"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "high"}},
        {"type": "image_url", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        {"type": "image_url"},
    ]
) | st.builds(lambda junk: {"type": "image_url", "image_url": {"url": junk}}, bad_text)
bad_message = (
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["wizard", "", "user"]),
            "content": bad_text
            | st.lists(st.fixed_dictionaries({"type": st.just("image_url"), "text": text}), min_size=1)
            | st.lists(bad_image_part, min_size=1, max_size=2),
        }
    )
    | JUNK
)
CHAT = {
    "messages": (st.lists(message, min_size=1, max_size=3), st.lists(bad_message, max_size=3) | JUNK),
    "max_tokens": MAX_TOKENS,
    "logprobs": (st.booleans(), JUNK),
    "top_logprobs": (st.integers(0, 3), BAD_INT),
}
REQUIRED = {"completions": ("prompt", "max_tokens"), "chat": ("messages", "max_tokens")}


@st.composite
def bodies_for(draw, kind: str, focus: tuple[str, ...] = ()):
    """A valid body, and in half the examples one or two of its fields broken. With `focus`, one of those fields is
    always in the body (grammars and tools would otherwise be drawn into few examples)."""
    fields = {**SAMPLING, **STRUCTURED, **(COMPLETIONS if kind == "completions" else {**CHAT, **TOOLS})}
    optional = [f for f in fields if f not in REQUIRED[kind]]
    chosen = list(REQUIRED[kind]) + draw(st.lists(st.sampled_from(optional), max_size=8, unique=True))
    if focus:
        chosen.append(draw(st.sampled_from(focus)))
        if chosen[-1] == "tool_choice":
            chosen.append("tools")
    body = {name: draw(fields[name][0]) for name in chosen}
    if kind == "chat" and "top_logprobs" in body:
        body["logprobs"] = True
    broken = sorted(focus) if focus and draw(st.booleans()) else sorted(fields)
    for name in draw(st.lists(st.sampled_from(broken), max_size=2, unique=True)):
        body[name] = draw(fields[name][1])
    return body


def check(url: str, path: str, body: dict) -> None:
    content = json.dumps(body, allow_nan=True, ensure_ascii=True)
    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500
        ErrorResponse.model_validate(r.json())
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text
        for e in events[:-1]:
            payload = json.loads(e)
            assert "error" not in payload, payload
            if path == "/v1/chat/completions":
                ChatCompletionChunk.model_validate(payload)
        return
    model = CompletionResponse if path == "/v1/completions" else ChatCompletionResponse
    model.model_validate(r.json())


def fuzz(url: str, examples: int):
    common = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=examples <= 300,  # the default suite sees the same examples every run
        suppress_health_check=list(HealthCheck),
    )

    @common
    @given(bodies_for("completions"))
    def completions(body):
        check(url, "/v1/completions", body)

    @common
    @given(bodies_for("chat"))
    def chat(body):
        check(url, "/v1/chat/completions", body)

    @common
    @given(bodies_for("completions", focus=tuple(STRUCTURED)))
    def completions_with_grammars(body):
        check(url, "/v1/completions", body)

    @common
    @given(bodies_for("chat", focus=(*STRUCTURED, *TOOLS)))
    def chat_with_grammars_and_tools(body):
        check(url, "/v1/chat/completions", body)

    completions()
    chat()
    completions_with_grammars()
    chat_with_grammars_and_tools()


def settle(server, timeout=15.0):
    """Wait for the core's gauges to show nothing held (they refresh at each idle tick)."""
    deadline = time.time() + timeout
    names = ("fulcrum:num_requests_running", "fulcrum:num_requests_waiting", "fulcrum:kv_cache_usage_perc")
    while time.time() < deadline:
        values = [metric(server, n) for n in names]
        if values == [0, 0, 0]:
            return values
        time.sleep(0.2)
    return values


# tool_choice auto reads calls with a parser; a compile that needs gigabytes fails fast at a small cap
FUZZ_FLAGS = ("--tool-call-parser", "hermes", "--grammar-compile-memory", "256")


def run_fuzz(tmp_path, examples: int, through_router: bool = False):
    s = start_server(tmp_path, *FUZZ_FLAGS)
    try:
        greedy = {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}
        before = httpx.post(f"{s.url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        if through_router:
            with router_process(tmp_path, "--replica", s.url) as url:
                fuzz(url, examples)
                assert httpx.get(f"{url}/health").status_code == 200
        else:
            fuzz(s.url, examples)
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert settle(s) == [0, 0, 0]
        after = httpx.post(f"{s.url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        assert after == before
    finally:
        s.stop()


def test_fuzzed_requests_never_5xx_and_leave_nothing_behind(tmp_path):
    run_fuzz(tmp_path, examples=200)  # per endpoint


def test_fuzzed_requests_through_the_router(tmp_path):
    """The router's own layer (body checks, its error shape, forwarding a streamed or refused answer) holds too."""
    run_fuzz(tmp_path, examples=60, through_router=True)


@pytest.mark.slow
def test_fuzzed_requests_many(tmp_path):
    run_fuzz(tmp_path, examples=2000)
