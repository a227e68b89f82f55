"""Images through /v1/chat/completions on `fulcrum serve` of a tiny Qwen2.5-VL: an `image_url` data URL's answer is
transformers' `generate` on the same processor output; malformed images, an http URL, too many images and an image
for a text-only model are 400s naming the field, and the server answers on."""

from __future__ import annotations

import base64

import httpx
import pytest
from transformers import AutoTokenizer

from fulcrum.utils.serve_process import free_port, start
from tests.models.test_vision_images import transformers_tokens
from tests.servers import Server
from tests.tiny_vision import png, save_tiny_vision_model

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-srv")
    folder = save_tiny_vision_model("qwen2_5-vl", root / "m")
    flags = ["--dtype", "float32", "--kv-cache-memory", "0.05", "--served-model-name", "vl"]
    s = start(str(folder), *flags, log_path=root / f"server-{free_port()}.log", timeout=120)
    server = Server(s.proc, s.port, s.log_path)
    yield server, folder
    server.stop()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(url: str, parts: list, model: str = "vl", ignore_eos: bool = True) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": ignore_eos}  # fmt: skip
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_an_image_answer_is_transformers_generate(vl_server):
    server, folder = vl_server
    image = png(7, size=(56, 112))
    parts = [{"type": "text", "text": "what is in "}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    r = chat(server.url, parts)
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "what is in " + PLACEHOLDER}], add_generation_prompt=True, tokenize=False
    )
    expected = tok.decode(transformers_tokens(folder, prompt, [image], 6), skip_special_tokens=True)
    assert r.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://example.com/cat.png", "downloads are off"),
        ("data:image/png;base64,@@not-base64@@", "base64 does not decode"),
        (data_url(b"these bytes are no image"), "not an image file"),
        ("file:///etc/passwd", "must be a data URL"),
    ],
)
def test_a_bad_image_is_a_400_naming_the_part(vl_server, url, message):
    server, _ = vl_server
    parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]
    r = chat(server.url, parts)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "messages[0].content[1].image_url"
    ok = chat(server.url, [{"type": "image_url", "image_url": {"url": data_url(png(8))}}])
    assert ok.status_code == 200, ok.text


def test_too_many_images_are_a_400(vl_server):
    server, _ = vl_server
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(i))}} for i in range(9)]
    r = chat(server.url, parts)
    assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"]


def test_an_image_for_a_text_only_model_is_a_400(server):
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(1))}}]
    r = chat(server.url, parts, model="shakespeare")
    assert r.status_code == 400
    assert "takes no image input" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url"
    assert chat(server.url, [{"type": "text", "text": "hi"}], model="shakespeare").status_code == 200


def test_responses_and_messages_routes_take_the_same_image(vl_server):
    """Responses' input_image and Anthropic's base64 image block mean the chat route's image_url part."""
    server, _ = vl_server
    image = png(9, size=(84, 56))
    b64 = base64.b64encode(image).decode()
    parts = [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    chat_text = chat(server.url, parts, ignore_eos=False)  # the other routes take no ignore_eos
    want = chat_text.json()["choices"][0]["message"]["content"]
    assert want  # text to compare (not an answer cut at once by the end-of-sequence token)
    responses = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "vl", "max_output_tokens": 6, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "see "},
                                               {"type": "input_image", "image_url": data_url(image)}]}],
    })  # fmt: skip
    assert responses.status_code == 200, responses.text[:600]
    assert responses.json()["output"][-1]["content"][0]["text"] == want
    messages = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "vl", "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "see "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}],
    })  # fmt: skip
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == want


def test_an_unimplemented_detail_is_a_400(vl_server):
    server, _ = vl_server
    part = {"type": "image_url", "image_url": {"url": data_url(png(1)), "detail": "low"}}
    r = chat(server.url, [part])
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content")
    part["image_url"]["detail"] = "auto"
    assert chat(server.url, [part]).status_code == 200
