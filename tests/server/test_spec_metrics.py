"""`fulcrum serve --speculative-config`: greedy text as without speculation, streamed with several tokens in some
chunks, and speculative decoding's counters in /metrics under our names and, with --metrics-compat vllm, vLLM's."""

import json
import re

import httpx
import openai
import pytest

from tests.engine.test_spec_decode import PASSAGE, ngram

PROMPT = f"Say it again.\n{PASSAGE}\n\n{PASSAGE[:40]}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tests.servers import start_server

    root = tmp_path_factory.mktemp("spec-srv")
    plain = start_server(root)
    spec = start_server(root, "--speculative-config", json.dumps(ngram(4)), "--metrics-compat", "vllm")
    yield plain, spec
    plain.stop()
    spec.stop()


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_streamed_greedy_text_is_the_text_without_speculation(servers):
    plain, spec = servers
    kw = dict(model="shakespeare", prompt=PROMPT, max_tokens=48, temperature=0)
    want = client(plain).completions.create(**kw).choices[0].text
    chunks = list(client(spec).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == want
    assert chunks[-1].usage.completion_tokens == 48
    # accepted proposals arrive together: fewer chunks than tokens
    assert len(pieces) < 48
    assert client(spec).completions.create(**kw).choices[0].text == want


def answer(server, stream: bool, **kw):
    """Text, token strings (of logprobs) and completion_tokens of one completion, streamed or not."""
    c = client(server).completions
    if not stream:
        r = c.create(logprobs=1, **kw)
        return r.choices[0].text, r.choices[0].logprobs.tokens, r.usage.completion_tokens, r.choices[0].finish_reason
    chunks = list(c.create(logprobs=1, stream=True, stream_options={"include_usage": True}, **kw))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    toks = [t for ch in choices if ch.logprobs for t in ch.logprobs.tokens]
    return "".join(ch.text for ch in choices), toks, chunks[-1].usage.completion_tokens, choices[-1].finish_reason


def test_a_stop_string_inside_a_proposal_counts_as_without_speculation(servers):
    """The tokens after the one that completes a stop string are dropped in one step's proposals: text, logprobs
    and completion_tokens as without speculation, streamed and not."""
    plain, spec = servers
    kw = dict(model="shakespeare", prompt=PROMPT, max_tokens=40, temperature=0)
    toks = answer(plain, False, **kw)[1]
    # the text of three tokens ending at several places of the output
    for j in range(5, 35, 3):
        stop = "".join(toks[j - 2 : j + 1])
        want = answer(plain, False, stop=[stop], **kw)
        assert want[3] == "stop" and len(want[1]) == want[2] <= j + 1
        for stream in (False, True):
            assert answer(spec, stream, stop=[stop], **kw) == want, (stop, stream)


def metric(text: str, name: str, **labels) -> float:
    want = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}\{{{want}[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} {labels} missing from /metrics"
    return float(m[1])


def test_metrics_count_proposals_under_both_names(servers):
    _, spec = servers
    client(spec).completions.create(model="shakespeare", prompt=PROMPT, max_tokens=32, temperature=0)
    text = httpx.get(f"{spec.url}/metrics").text
    for prefix in ("fulcrum", "vllm"):
        drafts = metric(text, f"{prefix}:spec_decode_num_drafts_total")
        proposed = metric(text, f"{prefix}:spec_decode_num_draft_tokens_total")
        accepted = metric(text, f"{prefix}:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and proposed >= accepted > 0
        first = metric(text, f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        assert 0 < first <= drafts
    rate = metric(text, "fulcrum:spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / proposed, rel=1e-6)
    assert metric(text, "fulcrum:spec_decode_mean_accepted_length") == pytest.approx(1 + accepted / drafts, rel=1e-6)


def test_generation_tokens_count_what_was_answered_when_a_stop_string_cuts_a_proposal(servers):
    plain, spec = servers
    kw = dict(model="shakespeare", prompt=PROMPT, max_tokens=40, temperature=0)
    toks = answer(plain, False, **kw)[1]

    def generated() -> float:  # absent until the first token
        text = httpx.get(f"{spec.url}/metrics").text
        return metric(text, "fulcrum:generation_tokens_total") if "fulcrum:generation_tokens_total{" in text else 0

    for j in range(5, 35, 6):
        before = generated()
        got = answer(spec, False, stop=["".join(toks[j - 2 : j + 1])], **kw)
        after = generated()
        assert after - before == got[2]  # usage's completion_tokens, not what the engine made past the stop
