"""Streaming text is correct UTF-8 and never shows a stop string, through DecodeStream (a fast
tokenizer) and through the window decode (any other tokenizer) alike."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from fulcrum.config import DEFAULT_MODEL
from fulcrum.engine.detokenizer import IncrementalDetokenizer
from fulcrum.utils.tokenizer import load_tokenizer

TOK = load_tokenizer(DEFAULT_MODEL)


class WindowOnly:
    """A tokenizer without its Rust backend, as one that is not a fast tokenizer looks."""

    def __init__(self, tokenizer=TOK):
        self.tokenizer = tokenizer

    def decode(self, *args, **kw):
        return self.tokenizer.decode(*args, **kw)


@pytest.fixture(params=["decode_stream", "window"])
def detok_tokenizer(request):
    return TOK if request.param == "decode_stream" else WindowOnly()


def stream(
    text: str, prompt: str = "Say:", tokenizer=TOK, **kw
) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    return stream_ids(TOK(text)["input_ids"], prompt, tokenizer, **kw)


def stream_ids(ids: list[int], prompt: str = "Say:", tokenizer=TOK, **kw):
    detok = IncrementalDetokenizer(tokenizer, TOK(prompt)["input_ids"], **kw)
    deltas, hit = [], None
    for t in ids:
        hit = detok.add_tokens([t])
        deltas.append(detok.take_delta(finished=hit is not None))
        if hit:
            break
    if hit is None:
        detok.flush()
        deltas.append(detok.take_delta(finished=True))
    return deltas, detok, hit


def test_multibyte_characters_split_across_tokens_stream_whole(detok_tokenizer):
    text = "Héllo wörld — 世界 🎭 naïve ﬁn"
    ids = TOK(text)["input_ids"]
    # the byte-level vocabulary was trained on English: these characters span several tokens
    assert len(ids) > len(text.split())
    deltas, detok, _ = stream(text, tokenizer=detok_tokenizer)
    assert "".join(deltas) == text == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_truncates_and_never_leaks(detok_tokenizer):
    text = "To be, or not to be: that is the question"
    deltas, detok, hit = stream(text, tokenizer=detok_tokenizer, stop=["that is"])
    assert hit == "that is"
    assert detok.output_text == "To be, or not to be: "
    assert "".join(deltas) == detok.output_text
    assert not any("that" in d for d in deltas)


def test_stop_string_can_be_kept(detok_tokenizer):
    _, detok, _ = stream(
        "Fair is foul, and foul is fair", tokenizer=detok_tokenizer, stop=["foul"], include_stop_str_in_output=True
    )
    assert detok.output_text == "Fair is foul"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_and_window_give_the_same_text(skip_special_tokens):
    # what a model samples is not always text: random ids break characters and hit special tokens
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(TOK)) for _ in range(rng.randrange(1, 40))]
        fast = stream_ids(ids, skip_special_tokens=skip_special_tokens)
        window = stream_ids(ids, tokenizer=WindowOnly(), skip_special_tokens=skip_special_tokens)
        assert fast[0] == window[0] and fast[1].output_text == window[1].output_text


def test_a_decoder_whose_text_is_not_monotonic_falls_back_to_the_window():
    # Llama-style byte fallback then a strip of the leading space: after the bytes 00 FD, the token "▁a" makes
    # DecodeStream raise "Invalid prefix encountered" (vLLM issue 17448); the request goes on with the window
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁a": 257}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = [vocab["<0x00>"], vocab["<0xFD>"], vocab["▁a"], vocab["▁a"]]
    texts = []
    for tokenizer in (tok, WindowOnly(tok)):
        detok = IncrementalDetokenizer(tokenizer, [])
        deltas = [(detok.add_tokens([t]), detok.take_delta(finished=False))[1] for t in ids]
        detok.flush()
        texts.append((deltas + [detok.take_delta(finished=True)], detok.output_text))
    assert texts[0] == texts[1]
    assert texts[0][1].endswith(" a a")


@pytest.mark.parametrize("prompt", ["JWARWIC\ufffd", " mer shameudAs Yp\ufffd", "cut mid-character: 世"])
def test_a_prompt_ending_in_a_replacement_character_never_leaks_into_the_output(detok_tokenizer, prompt):
    ids = TOK(prompt)["input_ids"]
    if prompt.endswith("世"):  # a prompt of token ids cut inside a character's bytes
        ids = ids[:-1]
    text = ",\nAnd all the other"
    detok = IncrementalDetokenizer(detok_tokenizer, ids)
    detok.add_tokens(TOK(text)["input_ids"])
    assert detok.flush() == text


def test_several_tokens_at_once_are_read_up_to_the_one_that_completes_a_stop(detok_tokenizer):
    """Speculative decoding hands several tokens in one step: `taken` counts those up to the one that completed
    the stop string, and the text is what one token at a time gives."""
    text = "Now is the winter of our discontent made glorious summer"
    ids = TOK(text)["input_ids"]
    _, one_by_one, hit = stream_ids(ids, stop=["our disc"])
    assert hit == "our disc"
    detok = IncrementalDetokenizer(detok_tokenizer, TOK("Say:")["input_ids"], stop=["our disc"])
    assert detok.add_tokens(ids) == "our disc"
    assert detok.output_text == one_by_one.output_text == "Now is the winter of "
    completing = next(m for m in range(len(ids) + 1) if "our disc" in TOK.decode(ids[:m]))
    assert detok.taken == completing < len(ids)
    assert detok.add_tokens(ids[:3]) is None and detok.taken == 3
