"""Multi-LoRA through `fulcrum serve --lora-modules ... --allow-runtime-lora-updating`: adapters are model names in
/v1/models (with their parent) and in a request's `model` field, their answers are PEFT's merged models' greedy tokens;
an adapter is loaded and unloaded while another request streams, and unloading one whose request runs is refused
until it ends; a bad adapter is a 400 that disturbs nothing; the adapters' metrics are served."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from fulcrum.utils.serve_process import free_port, start
from fulcrum.utils.tokenizer import load_tokenizer
from tests.engine.test_lora import SHORT, TARGETS, make_adapter, merged_tokens
from tests.servers import Server
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-srv")
    base = save_tiny_model("qwen3", root / "base")
    adapters = [make_adapter(base, root / f"a{i}", t, r, rs, seed=100 + i) for i, (t, r, rs) in enumerate(TARGETS)]
    big = make_adapter(base, root / "big", ["q_proj"], 32)
    flags = ["--dtype", "float32", "--kv-cache-memory", "0.05", "--served-model-name", "base", "--max-lora-rank",
             "16", "--max-loras", "2", "--max-num-seqs", "2", "--allow-runtime-lora-updating",
             "--lora-modules", f"a0={adapters[0]}", f"a1={adapters[1]}"]  # fmt: skip
    s = start(str(base), *flags, log_path=root / f"server-{free_port()}.log", timeout=120)
    server = Server(s.proc, s.port, s.log_path)
    yield server, base, adapters, big
    server.stop()


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="none", max_retries=0)


def text_of(base, ids) -> str:
    return load_tokenizer(base).decode(ids)


def complete(client, model, max_tokens=10):
    r = client.completions.create(model=model, prompt=SHORT, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    return r.choices[0].text


def test_models_lists_the_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a0", "a1"}
    assert cards["a0"].parent == "base" and cards["a1"].parent == "base"
    assert client.models.retrieve("a1").id == "a1"


def test_each_adapter_answers_as_peft_merged(setup, client):
    _, base, adapters, _ = setup
    for model, adapter in (("base", None), ("a0", adapters[0]), ("a1", adapters[1])):
        assert complete(client, model) == text_of(base, merged_tokens(base, adapter, SHORT)), model
    with pytest.raises(openai.NotFoundError):
        complete(client, "a9")


def test_load_and_unload_while_another_request_streams(setup, client):
    server, base, adapters, big = setup
    streams: list[list[str]] = [[] for _ in range(6)]  # two run at a time (--max-num-seqs 2): the rest queue
    errors = []

    def stream(out):
        try:
            for chunk in client.completions.create(model="a0", prompt=SHORT, max_tokens=400, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
                out.append(chunk.choices[0].text)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(out,)) for out in streams]
    for t in threads:
        t.start()
    while not any(streams):  # the streams are under way
        threads[0].join(0.01)
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters[2])})
    assert r.status_code == 200, r.text
    busy = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"})
    assert any(t.is_alive() for t in threads)
    assert busy.status_code == 400 and "request(s) queued or running" in busy.json()["error"]["message"], busy.text
    bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert bad.status_code == 400 and "max-lora-rank" in bad.json()["error"]["message"]
    for t in threads:
        t.join(300)
    assert not errors, errors
    want = text_of(base, merged_tokens(base, adapters[0], SHORT, 400))
    assert all("".join(out) == want for out in streams)  # none broken by the loads and the refused unload
    assert complete(client, "a2") == text_of(base, merged_tokens(base, adapters[2], SHORT))
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"}).status_code == 200
    assert {m.id for m in client.models.list().data} == {"base", "a1", "a2"}
    with pytest.raises(openai.NotFoundError):
        complete(client, "a0")
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"})
    assert gone.status_code == 404


def test_adapter_metrics(setup, client):
    server = setup[0]
    complete(client, "a1")
    text = httpx.get(server.url + "/metrics").text
    loads = [ln for ln in text.splitlines() if ln.startswith("fulcrum:lora_loads_total")]
    assert loads and float(loads[0].split()[-1]) >= 2
    assert 'fulcrum:lora_requests_info{max_lora="2"' in text


def test_every_route_runs_the_adapter_it_names(setup, client):
    _, base, adapters, _ = setup
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)  # fmt: skip
    assert chat.model == "a1"
    resp = client.responses.create(model="a1", input="hi", max_output_tokens=6, temperature=0)
    assert resp.model == "a1" and resp.output_text == chat.choices[0].message.content
    base_chat = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0)  # fmt: skip
    assert base_chat.model == "base" and base_chat.choices[0].message.content != chat.choices[0].message.content
