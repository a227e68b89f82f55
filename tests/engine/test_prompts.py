"""One prompt normaliser for the server and LLM.generate: every shape users send, as (text, token ids)."""

import pytest

from fulcrum.config import DEFAULT_MODEL
from fulcrum.engine.prompts import tokenize_prompts
from fulcrum.errors import InvalidRequestError
from fulcrum.utils.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL)


def test_every_shape(tok):
    ids = tok("ROMEO:")["input_ids"]
    assert tokenize_prompts("ROMEO:", tok) == [("ROMEO:", ids)]
    assert tokenize_prompts(ids, tok) == [(None, ids)]
    assert tokenize_prompts([ids, [5, 6]], tok) == [(None, ids), (None, [5, 6])]
    assert tokenize_prompts(["ROMEO:", "ROMEO:"], tok) == [("ROMEO:", ids)] * 2
    assert tokenize_prompts({"prompt": "ROMEO:"}, tok) == [("ROMEO:", ids)]
    assert tokenize_prompts([{"prompt_token_ids": [1, 2]}, "ROMEO:"], tok) == [(None, [1, 2]), ("ROMEO:", ids)]


@pytest.mark.parametrize("bad", [[[True]], [1.5], [None], [{"text": "x"}]])
def test_other_shapes_are_refused(tok, bad):
    with pytest.raises(InvalidRequestError) as e:
        tokenize_prompts(bad, tok)
    assert e.value.param == "prompt"
