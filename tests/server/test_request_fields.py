"""No request field silently ignored (issue 15): every field of OpenAI's and vLLM's request schemas, on both
endpoints, is either implemented (its effect checked here) or refused with a 400 naming it; unknown fields are
refused too. And prompt logprobs (echo with logprobs, max_tokens 0, vLLM's prompt_logprobs), logit_bias and
usage.prompt_tokens_details.cached_tokens over HTTP."""

import json

import pytest

from fulcrum.protocol import IMPLEMENTED, NO_EFFECT, REFUSED, REQUEST_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.server.test_http_errors import assert_error, post

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {
    CMPL: {"prompt": "ROMEO:", "max_tokens": 6, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": "Hail"}], "max_tokens": 6, "temperature": 0},
}


def ok(server, path, **extra):
    r = post(server, path, {**BASE[path], **extra})
    assert r.status_code == 200, (extra, r.text)
    return r


def text(body, i=0):
    c = body["choices"][i]
    return c["text"] if "text" in c else c["message"]["content"]


def ids_of(server, s):
    return post(server, "/tokenize", {"prompt": s, "add_special_tokens": False}).json()["tokens"]


@pytest.fixture(scope="module")
def base(server):
    return {path: ok(server, path).json() for path in BASE}


def sse_events(r):
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# An implemented field: (value to send, what must hold of the 200 answer given the base answer).
EFFECTS = {
    "model": ("shakespeare", lambda b, base, path: text(b) == text(base)),
    "max_tokens": (3, lambda b, base, path: b["usage"]["completion_tokens"] <= 3),
    "temperature": (0, lambda b, base, path: text(b) == text(base)),
    "top_p": (1e-6, lambda b, base, path: text(b) == text(base)),  # with temperature 1 below: greedy
    "n": (2, lambda b, base, path: len(b["choices"]) == 2),
    "seed": (7, lambda b, base, path: b["usage"]["completion_tokens"] >= 1),
    "presence_penalty": (2.0, lambda b, base, path: b["usage"]["completion_tokens"] >= 1),
    "frequency_penalty": (2.0, lambda b, base, path: b["usage"]["completion_tokens"] >= 1),
    "repetition_penalty": (1.5, lambda b, base, path: b["usage"]["completion_tokens"] >= 1),
    "user": ("someone", lambda b, base, path: text(b) == text(base)),
    "metadata": ({"k": "v"}, lambda b, base, path: text(b) == text(base)),
    "prompt_cache_key": ("k", lambda b, base, path: text(b) == text(base)),
    "safety_identifier": ("s", lambda b, base, path: text(b) == text(base)),
    "top_k": (1, lambda b, base, path: text(b) == text(base)),  # with temperature 1 below: greedy
    "min_p": (1.0, lambda b, base, path: text(b) == text(base)),  # keeps only the most likely token
    "ignore_eos": (True, lambda b, base, path: b["usage"]["completion_tokens"] == 6),
    "min_tokens": (6, lambda b, base, path: b["usage"]["completion_tokens"] == 6),
    "skip_special_tokens": (False, lambda b, base, path: b["choices"][0]["finish_reason"] is not None),
    "priority": (-5, lambda b, base, path: text(b) == text(base)),
    "prompt_logprobs": (
        1,
        lambda b, base, path: (b.get("prompt_logprobs") or b["choices"][0]["prompt_logprobs"])[0] is None,
    ),
    "echo": (True, lambda b, base, path: text(b) == "ROMEO:" + text(base)),
    "logprobs": (
        2,
        lambda b, base, path: len(b["choices"][0]["logprobs"]["tokens"]) == b["usage"]["completion_tokens"],
    ),
    "logprobs@chat": (
        True,
        lambda b, base, path: len(b["choices"][0]["logprobs"]["content"]) == b["usage"]["completion_tokens"],
    ),
    "best_of": (1, lambda b, base, path: text(b) == text(base)),
    "max_completion_tokens": (2, lambda b, base, path: b["usage"]["completion_tokens"] <= 2),
    # the bundled template reads no extra variable (tests/server/test_reasoning.py checks one that does)
    "chat_template_kwargs": ({"enable_thinking": False}, lambda b, base, path: text(b) == text(base)),
    "add_generation_prompt": (
        False,
        lambda b, base, path: b["usage"]["prompt_tokens"] < base["usage"]["prompt_tokens"],
    ),
    # structured output: each way of asking gives text the constraint allows
    "response_format": (
        {"type": "json_schema", "json_schema": {"name": "who", "schema": {"enum": ["Romeo", "Juliet"]}}},
        lambda b, base, path: text(b) in ('"Romeo"', '"Juliet"'),
    ),
    "structured_outputs": ({"choice": ["Romeo", "Juliet"]}, lambda b, base, path: text(b) in ("Romeo", "Juliet")),
    "guided_json": ({"const": "Romeo"}, lambda b, base, path: text(b) == '"Romeo"'),
    "guided_regex": ("(Romeo|Juliet)!", lambda b, base, path: text(b) in ("Romeo!", "Juliet!")),
    "guided_choice": (["Romeo", "Juliet"], lambda b, base, path: text(b) in ("Romeo", "Juliet")),
    "guided_grammar": ('root ::= "Ro" "meo"', lambda b, base, path: text(b) == "Romeo"),
    "structural_tag": (
        {"type": "structural_tag", "format": {"type": "const_string", "value": "Romeo"}},
        lambda b, base, path: text(b) == "Romeo",
    ),
}
# fields whose check needs a body of its own
SPECIAL = {
    "prompt",
    "messages",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "logit_bias",
    "stream",
    "stream_options",
    "top_logprobs",
    "tools",  # with tool_choice and parallel_tool_calls: below, and tests/server/test_tools.py
    "tool_choice",
    "parallel_tool_calls",
    "kv_transfer_params",  # the P/D handshake needs KV roles: tests/router/test_pd.py, tests/engine/test_kv_transfer.py
}
TEMPERATURE_1 = {"top_p", "top_k", "min_p", "seed"}
# a non-default value a client could really send for a refused field (others get a made-up string)
NON_DEFAULT = {
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": {"name": "f"},
    "use_beam_search": True,
    "length_penalty": 2.0,
    "spaces_between_special_tokens": False,
    "suffix": "end",
    "echo": True,
    "add_special_tokens": True,
    "best_of": 2,
    "store": True,
    "allowed_token_ids": [1, 2],
    "truncate_prompt_tokens": 3,
}


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_every_field_is_implemented_or_refused_with_a_400(server, base, path):
    table = REQUEST_FIELDS[path]
    checked = []
    for name, support in table.items():
        if support.status == REFUSED:
            bad = NON_DEFAULT.get(name, "not-a-default")
            if path == CMPL and name == "add_special_tokens":
                bad = False
            r = post(server, path, {**BASE[path], name: bad})
            assert_error(r, 400, name)
            assert "not supported" in r.json()["error"]["message"]
            for default in support.defaults:
                ok(server, path, **{name: default})
        elif name not in SPECIAL:
            assert support.status in (IMPLEMENTED, NO_EFFECT)
            value, holds = EFFECTS.get(f"{name}@chat" if path == CHAT else name, EFFECTS[name])
            extra = {name: value}
            if name in TEMPERATURE_1:
                extra["temperature"] = 1.0
            if name == "max_completion_tokens":
                extra["max_tokens"] = None
            body = ok(server, path, **extra).json()
            assert holds(body, base[path], path), (name, body)
        checked.append(name)
    assert checked == list(table)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_fields_that_need_bodies_of_their_own(server, base, path):
    greedy = text(base[path])
    assert len(greedy) >= 3
    # stop on the greedy text's third character, kept in the output or not
    stop = greedy[2]
    cut = ok(server, path, stop=[stop]).json()
    assert text(cut) == greedy[: greedy.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    kept = ok(server, path, stop=[stop], include_stop_str_in_output=True).json()
    assert text(kept) == greedy[: greedy.index(stop) + 1]
    # stop_token_ids: the first greedy token ends the request at once
    first = ok(server, path, max_tokens=1, logprobs=1 if path == CMPL else True).json()
    if path == CMPL:
        tok = ids_of(server, first["choices"][0]["logprobs"]["tokens"][0])[0]
    else:
        tok = ids_of(server, first["choices"][0]["logprobs"]["content"][0]["token"])[0]
    stopped = ok(server, path, stop_token_ids=[tok]).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["stop_reason"] == tok
    # logit_bias: +100 forces a token
    forced = ok(server, path, logit_bias={"42": 100}, ignore_eos=True).json()
    assert forced["usage"]["completion_tokens"] == 6
    assert text(forced) == post(server, "/detokenize", {"tokens": [42] * 6}).json()["prompt"]
    # stream and stream_options
    r = post(server, path, {**BASE[path], "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1]["usage"]["completion_tokens"] == base[path]["usage"]["completion_tokens"]
    if path == CHAT:
        lp = ok(server, path, logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]["content"]
        assert all(len(e["top_logprobs"]) == 2 for e in lp)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"enum": [{}]}}}
        called = ok(server, path, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=60)
        message = called.json()["choices"][0]["message"]
        assert [c["function"] for c in message["tool_calls"]] == [{"name": "f", "arguments": "{}"}]
    else:
        # prompt as token ids
        ids = ids_of(server, "ROMEO:")
        assert text(ok(server, path, prompt=ids).json()) == greedy


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("field", ["some_extension", "Temperature", "guided_jsons"])
def test_unknown_fields_are_400_naming_them(server, path, field):
    r = post(server, path, {**BASE[path], field: 1})
    assert_error(r, 400, field)
    assert "unknown field" in r.json()["error"]["message"]


def test_the_table_covers_every_field_of_the_openai_clients_request_types():
    """The official client's own request types (openai.types ... CompletionCreateParamsBase): a field a newer
    client sends shows up here, not as a silent 200."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    for path, params in [(CMPL, completion_create_params), (CHAT, chat_create_params)]:
        fields = set(params.CompletionCreateParamsBase.__annotations__)
        assert fields <= set(REQUEST_FIELDS[path]), fields - set(REQUEST_FIELDS[path])


@pytest.mark.parametrize("path, model", [(CMPL, CompletionRequest), (CHAT, ChatCompletionRequest)])
def test_the_table_agrees_with_the_request_models(path, model):
    table = REQUEST_FIELDS[path]
    implemented = {n for n, s in table.items() if s.status == IMPLEMENTED}
    assert (
        implemented <= set(model.model_fields) <= implemented | {n for n, s in table.items() if s.status == NO_EFFECT}
    )


def test_echo_with_logprobs_scores_the_prompt(server):
    prompt = "ROMEO: my lord"
    ids = ids_of(server, prompt)
    # lm-eval-harness's loglikelihood request
    r = ok(server, CMPL, prompt=prompt, max_tokens=0, echo=True, logprobs=1).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the same numbers as vLLM's prompt_logprobs of the same prompt, and the same with generation after it
    v = ok(server, CMPL, prompt=prompt, max_tokens=3, echo=True, logprobs=2, prompt_logprobs=2).json()["choices"][0]
    pl = v["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for i, tid in enumerate(ids[1:], 1):
        entry = pl[i][str(tid)]
        assert abs(entry["logprob"] - lp["token_logprobs"][i]) < 1e-5 and entry["rank"] >= 1
        assert abs(v["logprobs"]["token_logprobs"][i] - lp["token_logprobs"][i]) < 1e-5
    assert len(v["logprobs"]["tokens"]) == len(ids) + 3
    assert v["logprobs"]["text_offset"][len(ids)] == len(prompt)
    # max_tokens 0 without echo stays refused
    assert_error(post(server, CMPL, {"prompt": prompt, "max_tokens": 0}), 400, "max_tokens")


def test_echo_with_logprobs_streamed_starts_with_the_prompt(server):
    r = post(server, CMPL, {**BASE[CMPL], "stream": True, "echo": True, "logprobs": 1})
    first = sse_events(r)[0]["choices"][0]
    n = len(ids_of(server, "ROMEO:"))
    assert first["text"].startswith("ROMEO:")
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) >= n


def test_chat_prompt_logprobs(server):
    r = ok(server, CHAT, prompt_logprobs=0).json()
    pl = r["prompt_logprobs"]
    assert pl[0] is None and len(pl) == r["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in pl[1:])
    # streamed: on the first chunk with text, equal to the whole answer's
    events = sse_events(post(server, CHAT, {**BASE[CHAT], "prompt_logprobs": 0, "stream": True}))
    with_lp = [e for e in events if "prompt_logprobs" in e]
    assert len(with_lp) == 1 and with_lp[0]["prompt_logprobs"] == pl


def test_completion_prompt_logprobs_streamed(server):
    whole = ok(server, CMPL, prompt_logprobs=2, n=2).json()["choices"]
    events = sse_events(post(server, CMPL, {**BASE[CMPL], "prompt_logprobs": 2, "n": 2, "stream": True}))
    firsts = {}
    for e in events:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1]
    for i, c in firsts.items():
        assert c["prompt_logprobs"] == whole[i]["prompt_logprobs"]
    assert sum(1 for e in events for c in e["choices"] if c.get("prompt_logprobs")) == 2


def test_cached_tokens_in_usage(server):
    prefix = "KING: " + " ".join(["the crown and the sword of england"] * 12)
    a = ok(server, CMPL, prompt=prefix + " first").json()["usage"]
    b = ok(server, CMPL, prompt=prefix + " second").json()["usage"]
    assert a["prompt_tokens_details"]["cached_tokens"] < b["prompt_tokens_details"]["cached_tokens"]
    assert b["prompt_tokens_details"]["cached_tokens"] >= 32  # at least two full blocks of the shared prefix
    assert b["prompt_tokens_details"]["cached_tokens"] < b["prompt_tokens"]


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}},
            "response_format",
            "",
        ),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", ""),  # a key it does not have
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", ""),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_", "one output constraint"),
        ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar", "EBNF"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "structured output"),
    ],
)
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_structured_output_errors_are_400_naming_the_field(server, path, extra, param, message):
    r = post(server, path, {**BASE[path], **extra})
    assert_error(r, 400, param)
    assert message in r.json()["error"]["message"]


def test_unknown_keys_inside_tools_are_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}, "colour": "red"}}
    r = post(server, CHAT, {**BASE[CHAT], "tools": [tool], "tool_choice": "required"})
    assert_error(r, 400, "tools")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_kv_transfer_params_need_a_kv_engine(server, path):
    """A plain engine refuses the P/D handshake rather than ignore it (tests/router/test_pd.py has the real one)."""
    for params in ({"do_remote_decode": True}, {"do_remote_prefill": True}, {}):
        r = post(server, path, {**BASE[path], "kv_transfer_params": params})
        assert_error(r, 400, "kv_transfer_params")
        assert "--kv-role" in r.json()["error"]["message"]


def test_logprobs_of_tokens_a_grammar_rules_out_are_finite(server):
    """The fuzzer's find: alternatives the grammar masks have logprob -inf, which JSON cannot carry (a 500). They come
    back at vLLM's floor, -9999, in both shapes."""
    body = dict(prompt="0", max_tokens=1, logprobs=5, guided_json={"type": "string", "maxLength": 8})
    top = ok(server, CMPL, **body).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 5 and min(top.values()) == -9999.0  # the first token of a string can only be '"'
    chat = ok(server, CHAT, messages=[{"role": "user", "content": "x"}], max_tokens=1,
              logprobs=True, top_logprobs=5, guided_choice=["yes", "no"]).json()  # fmt: skip
    alternatives = chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(alternatives) == 5 and min(a["logprob"] for a in alternatives) == -9999.0
