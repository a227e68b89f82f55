"""Streaming text is correct UTF-8 and never shows a stop string."""

from fulcrum.config import DEFAULT_MODEL
from fulcrum.engine.detokenizer import IncrementalDetokenizer
from fulcrum.utils.tokenizer import load_tokenizer

TOK = load_tokenizer(DEFAULT_MODEL)


def stream(text: str, prompt: str = "Say:", **kw) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    detok = IncrementalDetokenizer(TOK, TOK(prompt)["input_ids"], **kw)
    deltas, hit = [], None
    for t in TOK(text)["input_ids"]:
        hit = detok.add_tokens([t])
        deltas.append(detok.take_delta(finished=hit is not None))
        if hit:
            break
    if hit is None:
        detok.flush()
        deltas.append(detok.take_delta(finished=True))
    return deltas, detok, hit


def test_multibyte_characters_split_across_tokens_stream_whole():
    text = "Héllo wörld — 世界 🎭 naïve ﬁn"
    ids = TOK(text)["input_ids"]
    # the byte-level vocabulary was trained on English: these characters span several tokens
    assert len(ids) > len(text.split())
    deltas, detok, _ = stream(text)
    assert "".join(deltas) == text == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_truncates_and_never_leaks():
    text = "To be, or not to be: that is the question"
    deltas, detok, hit = stream(text, stop=["that is"])
    assert hit == "that is"
    assert detok.output_text == "To be, or not to be: "
    assert "".join(deltas) == detok.output_text
    assert not any("that" in d for d in deltas)


def test_stop_string_can_be_kept():
    _, detok, _ = stream("Fair is foul, and foul is fair", stop=["foul"], include_stop_str_in_output=True)
    assert detok.output_text == "Fair is foul"
