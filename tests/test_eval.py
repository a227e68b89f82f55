"""`fulcrum eval`: a model against itself gives KL 0 and 100% agreement; a quantized run is scored against the
unquantized one; the windows score every token once."""

import json

import pytest

from fulcrum.cli import main
from fulcrum.config import DEFAULT_MODEL
from fulcrum.eval.perplexity import RunSpec, chunk_windows, evaluate, held_out_text, windows


@pytest.mark.parametrize("n, context, stride", [(10, 4, 2), (1000, 256, 128), (300, 256, 256), (5, 256, 128)])
def test_windows_score_every_token_after_the_first_once(n, context, stride):
    spans = windows(n, context, stride)
    scored = [i for start, end, first in spans for i in range(first, end)]
    assert scored == list(range(1, n))
    assert all(end - start <= context for start, end, _ in spans)


def test_a_bad_model_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    assert main(["eval", str(bad), "--chunks"]) == 2
    err = capsys.readouterr().err
    assert "is not a readable GGUF file" in err and len(err.strip().splitlines()) == 1
    assert main(["eval", "--chunks", "--context", "1"]) == 2
    assert "at least 2 tokens" in capsys.readouterr().err


def test_chunks_are_llama_perplexitys_second_halves(capsys):
    """--chunks scores as llama-perplexity does: whole chunks of --context tokens, the tail dropped, each scoring the
    tokens after its middle (so figures compare with llama.cpp's on the same file)."""
    assert chunk_windows(1030, 512) == [(0, 512, 257), (512, 1024, 769)]
    assert main(["eval", "--no-reference", "--context", "128", "--chunks", "--data", "/dev/null"]) == 2
    text = held_out_text()[:6000]
    r = evaluate(RunSpec(str(DEFAULT_MODEL)), text, context=128, chunks=True)
    assert r.tokens_scored == r.windows * 63 and r.windows >= 4  # a chunk of 128 scores its last 63 tokens
    assert 10 < r.perplexity < 200


def test_the_bundled_model_against_itself_and_int8(capsys):
    text = held_out_text()[:6000]
    same = evaluate(RunSpec(str(DEFAULT_MODEL)), text, RunSpec(str(DEFAULT_MODEL)), context=128)
    assert same.kl_mean == 0 and same.kl_p99 == 0 and same.top1_agreement == 1 and same.perplexity_ratio == 1
    assert 10 < same.perplexity < 200  # a trained model (validation loss 3.82 nats: perplexity ~46)

    assert main(["eval", "--quantization", "int8", "--data", "/dev/null"]) == 2  # an empty text: a clear error
    assert "shorter than two tokens" in capsys.readouterr().err
    assert main(["eval", "--quantization", "int8", "--context", "128", "--max-windows", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["reference"].endswith("quantization=none") and r["run"].endswith("quantization=int8")
    assert r["tokens_scored"] == 127 + 7 * 64
    assert 0 < r["kl_mean"] < 0.01 and r["top1_agreement"] > 0.95 and abs(r["perplexity_ratio"] - 1) < 0.01


def test_a_quantized_checkpoint_needs_its_reference_named(tmp_path, capsys):
    """The folder of a GPTQ/AWQ/compressed-tensors checkpoint has no unquantized weights to compare with."""
    folder = tmp_path / "gptq"
    folder.mkdir()
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["eval", str(folder), "--quantization", "gptq"]) == 2
    assert "--reference-model" in capsys.readouterr().err
