"""`fulcrum plan --validate --quantization ...`: the prediction counts the quantized weights, the engine really runs
quantized, and the two weight figures meet; what the engine would refuse is refused before anything is measured.
The machine probe is stubbed here (tests/probe/ runs it); the engine runs for real."""

import json

import pytest
from rich.console import Console

from fulcrum import config
from fulcrum.cli import main
from fulcrum.config import DEFAULT_MODEL
from fulcrum.plan import roofline, validate
from fulcrum.plan.model_spec import load_model_spec
from fulcrum.probe.engine_speed import measure_speed
from tests.plan.test_local import MEASURED  # an fp32 machine's figures

FP32_WEIGHT_BYTES = 6820096 * 4  # the bundled model as it ships
WEIGHT_TOLERANCE = 0.01  # predicted resident weight bytes against the engine's, relative


def test_plan_spells_the_formats_as_the_engine_does():
    # plan cannot import fulcrum.config (torch): its copies must not drift
    assert roofline.QUANT_METHODS == config.ONLINE_QUANTIZATIONS
    assert roofline.INT4_GROUP_SIZES == config.INT4_GROUP_SIZES
    assert ("auto", *validate.KV_CACHE_DTYPES) == config.KV_CACHE_DTYPES


def test_predicted_weight_bytes_of_the_bundled_model():
    spec = load_model_spec(DEFAULT_MODEL)
    linear = 8 * (512 * 256 + 256 * 256 + 1536 * 256 + 256 * 768) + 2048 * 256  # layers + the tied LM head
    rows = 8 * (512 + 256 + 1536 + 256) + 2048
    norms = 4352 * 4  # two per layer and the final one, fp32
    assert roofline.resident_weight_bytes(spec, "fp32") == FP32_WEIGHT_BYTES
    assert roofline.resident_weight_bytes(spec, "fp32", roofline.OnlineQuant("int8")) == linear + 4 * rows + norms
    int4 = roofline.OnlineQuant("int4", 64)
    assert roofline.resident_weight_bytes(spec, "fp32", int4) == linear / 2 + 8 * linear / 64 + norms
    # the tied table is the head: a decode step reads it as the head, once
    assert roofline.weight_bytes_read(spec, "fp32", 1, int4) == roofline.resident_weight_bytes(spec, "fp32", int4)


def _machine(calls):
    def measure_machine(spec, dtype, **kwargs):
        calls.append(kwargs)
        return MEASURED

    return measure_machine


@pytest.mark.parametrize(
    ("quantization", "group_size", "kv", "at_most"),
    [("int8", 128, "auto", 0.26), ("int4", 64, "fp8", 0.16)],  # fp32/4 + scales; fp32/8 + 2 fp32 per 64 weights
)
def test_validate_runs_the_engine_quantized_and_its_weights_meet_the_prediction(
    quantization, group_size, kv, at_most, capsys
):
    calls = []
    result = validate.validate(
        str(DEFAULT_MODEL),
        _machine(calls),
        measure_speed,
        input_len=32,
        output_len=6,
        batch_sizes=(1,),
        decode_prompt_len=16,
        quantization=quantization,
        group_size=group_size,
        kv_cache_dtype=kv,
        console=Console(width=200),  # one line a line
    )
    text = capsys.readouterr().out
    name = "int4 (group 64)" if quantization == "int4" else quantization
    kv_predicted = "fp8" if kv == "fp8" else "fp32"
    kv_measured = "fp8 with a scale per token and head" if kv == "fp8" else "float32"
    # both sides say what they ran: the probe and the engine were asked for it, and the engine reports it
    assert f"predicted for: weights {name}, KV cache {kv_predicted}" in text
    assert f"measured with: weights {name}, 33 layers quantized, KV cache {kv_measured}" in text
    assert calls[0]["quant"] == roofline.OnlineQuant(quantization, group_size) and calls[0]["kv_cache_dtype"] == kv
    got = result["measured"]
    assert got["quantization"] == name and got["quantized_layers"] == 33  # 8 layers x 4 linears + the LM head
    assert got["weight_bytes"] < at_most * FP32_WEIGHT_BYTES
    rows = {r["quantity"]: r for r in result["comparisons"]}
    weights = rows["resident weights (MB)"]
    assert weights["measured"] == got["weight_bytes"] / 1e6
    assert abs(weights["error"]) <= WEIGHT_TOLERANCE
    assert rows["decode batch 1: TPOT (ms)"]["measured"] > 0
    assert result["quantization"] == {"method": quantization, "group_size": group_size}


def _folder(tmp_path, **changes):
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **changes}))
    return str(tmp_path)


def test_combinations_the_engine_refuses_exit_2_with_a_message(capsys, tmp_path):
    def refused(*args):
        assert main(["plan", "--validate", *args]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    gptq = _folder(tmp_path / "gptq", quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    err = refused("--model", gptq, "--quantization", "int8")
    assert "already quantized (gptq)" in err and "--quantization int8" in err
    odd = _folder(tmp_path / "odd", intermediate_size=800)
    err = refused("--model", odd, "--quantization", "int4")
    assert "group size 128" in err and "800" in err and "group sizes that fit: 32" in err
    assert "disagree" in refused("--weight-dtype", "int8", "--quantization", "int4")
    assert "--weight-dtype bf16 is neither" in refused("--weight-dtype", "bf16")
    assert "not one" in refused("--model", "llama-3.1-8b", "--quantization", "int8")  # a preset: no engine to run
