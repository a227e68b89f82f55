"""`fulcrum plan` as a user runs it: presets, folders, JSON, a plot and errors (the measured runs, --hardware local
and --validate, are in tests/probe/)."""

import json

import pytest

from fulcrum.cli import main
from fulcrum.config import DEFAULT_MODEL


def test_plan_json_for_a_preset(capsys):
    assert main(["plan", "--model", "llama-3.1-70b", "--hardware", "H100-SXM", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    m = d["memory"]
    assert m["kv_per_token"] == 327680 and m["min_gpus"] == 4 and (m["tp"], m["pp"]) == (4, 1)
    assert m["fits"] is False  # 64 sequences of 32k do not fit on 4 cards
    assert "KV cache limits concurrency" in d["advice"][0]
    assert m["context"] == 32768  # the model allows 131072: the default 32k
    assert [p["batch"] for p in d["decode"]] == [1, 2, 4, 8, 16, 32, 64]


def test_plan_table_for_the_bundled_folder_and_a_plot(capsys, tmp_path):
    out = tmp_path / "plot.png"
    assert (
        main(["plan", "--model", str(DEFAULT_MODEL), "--hardware", "L4", "--price-per-hour", "0.8", "--plot", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "tiny-shakespeare-target" in text and "Fits on one L4" in text and "$ / 1M output tokens" in text
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plan_with_a_config_json_and_quantized_weights(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text((DEFAULT_MODEL / "config.json").read_text())
    assert main(["plan", "--model", str(cfg), "--weight-dtype", "int4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["weight_bytes"] == 6820096 * 0.5


@pytest.mark.parametrize(
    "quantization_config, fmt, per_weight",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4", 0.5),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "int4", 0.5),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}},
            },
            "fp8",
            1.0,
        ),
    ],
)
def test_plan_counts_a_quantized_checkpoints_weights_as_stored(capsys, tmp_path, quantization_config, fmt, per_weight):
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    assert main(["plan", "--model", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["weight_bytes"] == 6820096 * per_weight
    assert any(f"weights {fmt} ({per_weight:g} bytes/parameter, the checkpoint's" in a for a in d["assumptions"])


def test_plan_context_defaults_to_the_models_own_when_shorter(capsys, tmp_path):
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(path), "--hardware", "L4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["context"] == 2048
    assert d["assumptions"][0] == (
        "context 2,048 tokens per sequence: the model's max_position_embeddings (--context to change)"
    )
    assert main(["plan", "--model", str(path), "--hardware", "L4"]) == 0
    text = capsys.readouterr().out
    assert "KV cache per 2,048-token sequence" in text and "the model's max_position_embeddings" in text
    # an explicit --context is kept, and a context past what the model was trained for is pointed out
    assert main(["plan", "--model", str(path), "--hardware", "L4", "--context", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["context"] == 4096
    assert "beyond the model's max_position_embeddings (2,048)" in d["assumptions"][0]


def test_plan_errors_a_user_can_act_on(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "TPU-v9"]) == 2
    assert "known: H100-SXM" in capsys.readouterr().err
    assert main(["plan", "--model", "nope"]) == 2
    assert "presets: llama-3.1-8b" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tp", "-2"], "--tp"),
        (["--pp", "0"], "--pp"),
        (["--concurrency", "-1"], "--concurrency"),
        (["--context", "0"], "--context"),
        (["--input-len", "x"], "--input-len"),
        (["--price-per-hour", "-3"], "--price-per-hour"),
        (["--price-per-hour", "inf"], "--price-per-hour"),
    ],
)
def test_nonsense_flags_are_usage_errors(capsys, flags, named):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama-3.1-8b", *flags])
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, named",
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers must be a whole number from 1 to 10,000"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"num_attention_heads": True}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"intermediate_size": None}, "intermediate_size"),
    ],
)
def test_nonsense_configs_are_refused_at_once(capsys, tmp_path, change, named):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, **change}  # fmt: skip
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_config_that_is_not_json_or_not_an_object(capsys, tmp_path):
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "config.json").write_text(text)
        assert main(["plan", "--model", str(tmp_path)]) == 2
        assert "config.json" in capsys.readouterr().err
