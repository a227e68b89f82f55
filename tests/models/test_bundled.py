"""The models that ship in the repository: they load fast, are documented, and write Shakespeare."""

import re
import time

from fulcrum.config import DEFAULT_MODEL, ModelConfig
from fulcrum.models.loader import load_model
from fulcrum.utils.tokenizer import chat_prompt_ids, load_tokenizer
from tests.engine.reference import generate_ids

DRAFT = DEFAULT_MODEL.parent / "tiny-shakespeare-draft"


def card_value(folder, field):
    m = re.search(rf"\| {field} \| ([0-9.,]+)", (folder / "README.md").read_text())
    return float(m.group(1).replace(",", ""))


def test_bundled_models_load_in_under_two_seconds():
    for folder in [DEFAULT_MODEL, DRAFT]:
        t0 = time.perf_counter()
        load_model(ModelConfig.from_path(folder))
        load_tokenizer(folder)
        assert time.perf_counter() - t0 < 2.0


def test_cards_state_losses_and_target_beats_draft():
    target_val, draft_val = card_value(DEFAULT_MODEL, "validation loss"), card_value(DRAFT, "validation loss")
    assert target_val < draft_val - 0.05  # about 10% lower perplexity
    params = {f: card_value(f, "parameters") for f in [DEFAULT_MODEL, DRAFT]}
    assert 4e6 <= params[DEFAULT_MODEL] <= 10e6
    assert params[DRAFT] <= params[DEFAULT_MODEL] / 8
    model = load_model(ModelConfig.from_path(DEFAULT_MODEL))
    assert sum(p.numel() for p in model.parameters()) == params[DEFAULT_MODEL]


def test_greedy_romeo_reads_like_shakespeare():
    cfg = ModelConfig.from_path()
    model, tok = load_model(cfg), load_tokenizer(cfg.path)
    ids = list(generate_ids(model, tok("ROMEO:")["input_ids"], 60, cfg.eos_token_ids))
    text = tok.decode(ids, skip_special_tokens=True)
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 20
    common = {"the", "and", "to", "of", "i", "my", "a", "you", "that", "in", "is", "not", "me", "it", "with", "be"}
    assert sum(w.lower() in common for w in words) >= 3, text


def test_chat_template_renders_roles():
    tok = load_tokenizer(DEFAULT_MODEL)
    ids = chat_prompt_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hail!"}])
    text = tok.decode(ids)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHail!<|end|>\n<|assistant|>\n"
