"""Where `bench serve` finds a tokenizer without --tokenizer: the model's snapshot in the local Hugging Face cache
(found, never downloaded), and when neither the cache nor the server has one, approximate prompts with a warning.
The server's /tokenize against a real `fulcrum serve` is in test_bench_serve.py."""

from __future__ import annotations

import json
import shutil

import numpy as np

from fulcrum.bench.tokens import find_tokenizer
from fulcrum.bench.workloads import TextMaker
from fulcrum.cli import main
from fulcrum.config import DEFAULT_MODEL
from tests.bench.fake_server import FakeServer, serving_in_thread, stream, text_chunk

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(tmp_path, repo_id: str):
    """A Hugging Face cache holding `repo_id`'s config and tokenizer (no weights), laid out as the Hub client does."""
    root = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_MODEL / name, snap / name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def test_a_model_name_in_the_hugging_face_cache_gives_exact_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path, "bard/tiny-shakespeare")))
    # the server is not asked: nothing listens on port 9
    found = find_tokenizer("http://127.0.0.1:9", "bard/tiny-shakespeare", {})
    assert found.source == "exact (tokenizer of bard/tiny-shakespeare in the Hugging Face cache)"
    text = TextMaker(found.tokenizer)
    rng = np.random.default_rng(0)
    assert [text.count(text.make(n, rng)) for n in (5, 64, 200)] == [5, 64, 200]
    missing = find_tokenizer("http://127.0.0.1:9", "bard/not-cached", {})
    assert missing.tokenizer is None and missing.source.startswith("approximate")
    assert "has no snapshot of bard/not-cached" in missing.why_not[0] and "/tokenize" in missing.why_not[1]


def test_a_server_without_tokenize_gets_approximate_prompts_and_a_warning(tmp_path, capsys):
    out = tmp_path / "result.json"
    quick = stream((0.0, text_chunk("x")), done_at=0.0)
    with serving_in_thread(FakeServer({"*": quick})) as url:
        args = ["bench", "serve", "--base-url", url, "--quiet", "--model", "fake-model", "--input-len", "12",
                "--output-len", "1", "--num-prompts", "2", "--out", str(out)]  # fmt: skip
        assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning: prompt lengths are approximate" in err and "the server's /tokenize: 404" in err
    doc = json.loads(out.read_text())
    assert doc["prompt_lengths"] == "approximate (words, no tokenizer)" and doc["runs"][0]["summary"]["completed"] == 2
