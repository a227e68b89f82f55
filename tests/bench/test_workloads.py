"""Workloads: length distributions, exact prompt lengths, groups sharing a prefix, the long/short mix,
conversations, your own JSONL, and the same sessions from the same seed."""

import itertools
import json
import re

import numpy as np
import pytest

from fulcrum.bench.workloads import LengthDist, Session, TextMaker, WorkloadSpec, sessions
from fulcrum.config import DEFAULT_MODEL
from fulcrum.utils.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def text():
    return TextMaker(load_tokenizer(DEFAULT_MODEL))


def take(spec, text, n) -> list[Session]:
    return list(itertools.islice(sessions(spec, text), n))


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("256").sample(rng) == 256
    u = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(2000)]
    assert min(u) == 10 and max(u) == 20
    n = [LengthDist.parse("normal:100:10").sample(rng) for _ in range(5000)]
    assert np.mean(n) == pytest.approx(100, abs=1) and np.std(n) == pytest.approx(10, rel=0.1)
    assert min(LengthDist.parse("normal:2:50").sample(rng) for _ in range(500)) >= 1
    for bad in ("0", "uniform:5:2", "poisson:3", "ten"):
        with pytest.raises(ValueError, match="bad length"):
            LengthDist.parse(bad)


def test_random_prompts_have_the_asked_token_lengths(text):
    spec = WorkloadSpec("random", input_len=LengthDist.parse("uniform:1:300"), output_len=LengthDist.parse(7))
    got = take(spec, text, 40)
    gaps = [text.count(s.user_turns[0]) - s.input_lens[0] for s in got]
    assert all(abs(g) <= 1 for g in gaps) and gaps.count(0) >= 30
    assert all(s.max_tokens == [7] for s in got)


def test_without_a_tokenizer_prompts_are_words():
    s = take(WorkloadSpec("random", input_len=LengthDist.parse(50)), TextMaker(None), 1)[0]
    assert len(s.user_turns[0].split()) == 50


def test_same_seed_same_sessions_other_seed_others(text):
    a = take(WorkloadSpec("random", seed=1), text, 3)
    b = take(WorkloadSpec("random", seed=1), text, 3)
    c = take(WorkloadSpec("random", seed=2), text, 3)
    assert [s.user_turns for s in a] == [s.user_turns for s in b] != [s.user_turns for s in c]


def test_shared_prefix_groups(text):
    spec = WorkloadSpec("shared-prefix", num_groups=3, prefix_len=40, input_len=LengthDist.parse(5))
    got = take(spec, text, 9)
    prefixes = [s.system for s in got]
    assert len(set(prefixes)) == 3 and prefixes[0] == prefixes[3] == prefixes[6]
    assert abs(text.count(prefixes[0]) - 40) <= 1
    assert len({s.user_turns[0] for s in got}) == 9  # each request its own question


def test_long_prefill_mix(text):
    spec = WorkloadSpec(
        "long-prefill", long_fraction=0.25, long_input_len=LengthDist.parse(200), input_len=LengthDist.parse(10)
    )
    got = take(spec, text, 200)
    longs = [s for s in got if s.tag == "long"]
    assert 30 <= len(longs) <= 70
    assert all(s.input_lens == [200] for s in longs)
    assert all(s.input_lens == [10] for s in got if s.tag == "short")


def test_multi_turn_conversations(text):
    got = take(WorkloadSpec("multi-turn", turns=3, input_len=LengthDist.parse(8)), text, 2)
    assert [len(s.user_turns) for s in got] == [3, 3]
    assert got[0].turn_tags == ["turn 1", "turn 2", "turn 3"]


def test_jsonl_prompts_and_sharegpt(tmp_path, text):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "To be, or not", "max_tokens": 12},
        {"conversations": [{"from": "human", "value": "Who's there?"}, {"from": "gpt", "value": "Nay, answer me"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Speak"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = take(WorkloadSpec("jsonl", dataset=str(path), output_len=LengthDist.parse(9)), text, 6)
    prompts = {"To be, or not", "Who's there?", "Speak"}
    # each pass sends every usable line once, in an order drawn from the seed
    assert {s.user_turns[0] for s in got[:3]} == {s.user_turns[0] for s in got[3:]} == prompts
    by_prompt = {s.user_turns[0]: s.max_tokens for s in got}
    assert by_prompt["To be, or not"] == [12]
    assert by_prompt["Who's there?"] == [text.count("Nay, answer me")]  # the reply's length
    assert by_prompt["Speak"] == [9]  # no reply: --output-len
    orders = {
        tuple(s.user_turns[0] for s in take(WorkloadSpec("jsonl", dataset=str(path), seed=k), text, 3))
        for k in range(8)
    }
    assert len(orders) > 1  # the points of a sweep (seed + point) do not replay one order


def test_jsonl_errors_name_the_line(tmp_path, text):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "what is this"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        next(sessions(WorkloadSpec("jsonl", dataset=str(path)), text))
    with pytest.raises(ValueError, match="not found"):
        next(sessions(WorkloadSpec("jsonl", dataset=str(tmp_path / "missing.jsonl")), text))
    with pytest.raises(ValueError, match="needs --dataset"):
        next(sessions(WorkloadSpec("jsonl"), text))


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "bad.jsonl:2: each line must be a JSON object, not an array"),
        ('"just text"', "bad.jsonl:2: each line must be a JSON object, not a string"),
        ("null", "bad.jsonl:2: each line must be a JSON object, not null"),
        ('{"messages": ["hi"]}', "bad.jsonl:2: each turn of a conversation must be a JSON object"),
    ],
)
def test_jsonl_lines_that_are_not_objects_are_named(tmp_path, text, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        next(sessions(WorkloadSpec("jsonl", dataset=str(path)), text))
