"""`--reasoning-parser gpt_oss`: harmony's analysis channel goes to `reasoning_content`, its final channel to
`content`, the tags dropped, the same streamed (in any pieces) and whole. The server test runs the bundled model under
a harmony chat template of our own (`<|start|>ROLE<|message|>...<|end|>`, the generation prompt `<|start|>assistant`),
with a regex forcing the answer into two harmony messages."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from fulcrum.server.reasoning import HarmonyParser
from tests.server.test_reasoning import server_with_template, streamed

FULL = (
    "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)
CASES = [
    (FULL, ("Two and two.", "It is 4.")),
    ("<|channel|>final<|message|>Only an answer.<|return|>", (None, "Only an answer.")),
    ("<|channel|>analysis<|message|>cut short by max_tok", ("cut short by max_tok", None)),
    ("plain text, no header", (None, "plain text, no header")),
    ("<|channel|>analysis<|message|>a <| b < c<|end|>", ("a <| b < c", None)),  # text like a tag's start stays
    ("<|channel|>commentary<|message|>a preamble<|end|><|start|>assistant<|channel|>final<|message|>x",
     (None, "a preamblex")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>", ("ab", None)),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", ("a", None)),  # an unfinished header
]  # fmt: skip


@pytest.mark.parametrize(("text", "want"), CASES)
def test_split_whole_and_streamed_in_any_pieces(text, want):
    got = HarmonyParser().split(text)
    assert (got.reasoning, got.content) == want
    rng = random.Random(0)
    for _ in range(40):
        assert streamed(HarmonyParser(), text, rng) == want


TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}"
    "{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WORDS = "[a-z]{3,8}( [a-z]{3,8}){1,3}"
FORCED = {
    "regex": rf"<\|channel\|>analysis<\|message\|>{WORDS}<\|end\|><\|start\|>assistant<\|channel\|>final"
    rf"<\|message\|>{WORDS}<\|return\|>"
}


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    s = server_with_template(tmp_path_factory, TEMPLATE, "gpt_oss")
    yield s
    s.stop()


def test_the_analysis_channel_is_reasoning_content_whole_and_streamed(harmony_server):
    url = f"{harmony_server.url}/v1/chat/completions"
    body = {"model": "shakespeare", "messages": [{"role": "user", "content": "Think first."}], "max_tokens": 120,
            "temperature": 0, "structured_outputs": FORCED}  # fmt: skip
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"]
    assert "<|" not in msg["reasoning_content"] + msg["content"]
    thought, answer = "", ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    thought += ch["delta"].get("reasoning_content") or ""
                    answer += ch["delta"].get("content") or ""
    assert (thought, answer) == (msg["reasoning_content"], msg["content"])
