"""POST /v1/embeddings through the official `openai` client against `fulcrum serve` of a sentence-transformers model
(found to be one from its modules.json): vectors equal sentence-transformers', as floats and as base64, for texts
and token ids, with usage; dimensions and unknown fields refused with a 400 naming them; generation refused on an
embedding model and embeddings on a generative one; 64 inputs in one request, with every KV block given back."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from fulcrum.utils.serve_process import free_port, start
from tests.servers import Server, start_server
from tests.tiny_models import save_tiny_embedding_model

TEXTS = ["hello world", "the quick brown fox", "To be, or not to be, that is the question"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_embedding_model(tmp_path_factory.mktemp("st") / "m", "mean")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / f"server-{free_port()}.log"
    s = start(str(folder), "--kv-cache-memory", "0.05", "--dtype", "float32", log_path=log, timeout=120)
    s = Server(s.proc, s.port, s.log_path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(folder):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return lambda texts: model.encode(texts, convert_to_numpy=True)


@pytest.mark.parametrize("encoding_format", ["float", openai.NOT_GIVEN])  # the client's default asks for base64
def test_vectors_equal_sentence_transformers(client, reference, encoding_format):
    r = client.embeddings.create(input=TEXTS, model="m", encoding_format=encoding_format)
    got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    np.testing.assert_allclose(got, reference(TEXTS), atol=1e-4)
    assert r.object == "list" and r.data[0].object == "embedding"
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)


def test_base64_is_little_endian_float32(server, reference):
    body = httpx.post(server.url + "/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, reference(["hello world"])[0], atol=1e-4)


def test_token_ids_and_one_string(client, server, reference):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    by_ids = client.embeddings.create(input=[ids], model="m", encoding_format="float").data[0].embedding
    by_text = client.embeddings.create(input="hello world", model="m", encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    np.testing.assert_allclose(by_text, reference(["hello world"])[0], atol=1e-4)


def test_64_inputs_in_one_request(client, server, reference):
    texts = [f"document {i} is about {'cats' if i % 2 else 'dogs'} and {i * 7} other things" for i in range(64)]
    r = client.embeddings.create(input=texts, model="m", encoding_format="float")
    assert [d.index for d in r.data] == list(range(64))
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), reference(texts), atol=1e-4)
    metrics = httpx.get(server.url + "/metrics").text
    usage = [ln for ln in metrics.splitlines() if ln.startswith("fulcrum:kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0  # every block given back


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "dimensions": 8}, "dimensions"),  # not a matryoshka model
        ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[5, 999999]]}, "input"),
        ({"input": "hi", "priority": 2**70}, "priority"),
        ({}, "input"),
    ],
)
def test_refusals_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_generation_is_refused_on_an_embedding_model(client):
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client.completions.create(model="m", prompt="hello", max_tokens=4)


def test_a_generative_model_refuses_embeddings(tmp_path):
    s = start_server(tmp_path)
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.parametrize("body", ["{not json", '{"input": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_a_body_that_is_not_json_or_nests_too_deep_is_a_400(server, body):
    r = httpx.post(server.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "still here"}).status_code == 200
