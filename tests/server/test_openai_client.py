"""The server driven by the official `openai` client, as users drive vLLM."""

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from tests.servers import MODEL


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["shakespeare"]


def test_completion_greedy_equals_offline_engine(client):
    from fulcrum import LLM, SamplingParams

    r = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=24, temperature=0)
    llm = LLM(model=MODEL, kv_cache_memory=50 << 20)
    offline = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == offline.text
    assert r.usage.completion_tokens == len(offline.token_ids)
    assert r.usage.prompt_tokens == len(llm.tokenizer("ROMEO:")["input_ids"])
    assert r.choices[0].finish_reason == offline.finish_reason


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    kw = dict(model="shakespeare", prompt="JULIET:", max_tokens=40, temperature=0.9, seed=11)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []
    assert sum(1 for c in chunks if c.choices) > 5  # one chunk per engine step, not one blob


def test_chat_stream_and_not(client):
    msgs = [{"role": "system", "content": "Speak as a king."}, {"role": "user", "content": "What news?"}]
    whole = client.chat.completions.create(model="shakespeare", messages=msgs, max_completion_tokens=30, seed=3)
    parts = client.chat.completions.create(
        model="shakespeare", messages=msgs, max_completion_tokens=30, seed=3, stream=True
    )
    chunks = list(parts)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert whole.usage.completion_tokens <= 30 and whole.choices[0].finish_reason in ("stop", "length")


def test_n_samples_and_stop(client):
    r = client.completions.create(model="shakespeare", prompt="KING:", max_tokens=30, n=3, temperature=1.0, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    free = client.completions.create(model="shakespeare", prompt="KING:", max_tokens=30, temperature=0).choices[0].text
    stop = free[12:16]
    stopped = client.completions.create(model="shakespeare", prompt="KING:", max_tokens=30, temperature=0, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == free[: free.index(stop)]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_each_streamed_chunk_carries_the_logprobs_of_its_own_text(client, route):
    """Two samples stream at once (their frontend falls behind the engine's steps): every chunk's text is its
    tokens' strings laid end to end, never one chunk with the tokens of several and texts without any."""
    kw = dict(model="shakespeare", max_tokens=24, n=2, seed=7, stream=True, extra_body={"ignore_eos": True})
    if route == "chat":
        chunks = client.chat.completions.create(messages=[{"role": "user", "content": "Once more"}], logprobs=True,
                                                top_logprobs=2, **kw)  # fmt: skip
    else:
        chunks = client.completions.create(prompt="QUEEN:", logprobs=2, **kw)
    added = AutoTokenizer.from_pretrained(MODEL).added_tokens_decoder.values()
    special = {t.content for t in added if t.special}  # in logprobs, skipped in the text
    tokens = {0: 0, 1: 0}
    for chunk in chunks:
        for c in chunk.choices:
            if route == "chat":
                text, toks = c.delta.content or "", [t.token for t in (c.logprobs.content if c.logprobs else [])]
            else:
                text, toks = c.text, (c.logprobs.tokens if c.logprobs else [])
            assert text == "".join(t for t in toks if t not in special), (text, toks)
            tokens[c.index] += len(toks)
    assert tokens == {0: 24, 1: 24}


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 1 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(
        model="shakespeare",
        messages=[{"role": "user", "content": "Hail"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = c.choices[0].logprobs.content
    assert len(entries) == c.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    # greedy: the chosen token is the most likely one
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 for e in entries)


def test_echo_and_token_id_prompts(client):
    ids = client.post("/../tokenize", body={"prompt": "ROMEO:"}, cast_to=object)["tokens"]
    by_ids = client.completions.create(model="shakespeare", prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=8, temperature=0, echo=True)
    assert by_text.choices[0].text == "ROMEO:" + by_ids.choices[0].text


def test_32_concurrent_streams(server):
    async def one(c, i):
        text, finish = "", None
        stream = await c.completions.create(
            model="shakespeare", prompt=f"Citizen {i}:", max_tokens=24, temperature=0.8, seed=i, stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(finish in ("stop", "length") and text for text, finish in results)


def test_stop_strings_wait_for_min_tokens(client):
    """A stop string among the first min_tokens tokens does not end the answer (vLLM checks them only after),
    streamed or not; without min_tokens the same stop ends it at once."""
    kw = dict(model="shakespeare", prompt="ROMEO:", max_tokens=30, temperature=0, stop=["\n"])
    assert client.completions.create(**kw).usage.completion_tokens == 1  # the bundled model answers "\n" first
    whole = client.completions.create(**kw, extra_body={"min_tokens": 20})
    assert whole.usage.completion_tokens >= 20
    chunks = list(client.completions.create(**kw, extra_body={"min_tokens": 20}, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
