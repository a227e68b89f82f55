"""The weight loader on real Hugging Face folders: sharded or not, dtypes, and its errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fulcrum.config import ModelConfig, read_eos_token_ids
from fulcrum.errors import UnsupportedArchitectureError, WeightLoadError
from fulcrum.models.loader import load_model
from tests.models.test_parity import our_logits, prompts
from tests.tiny_models import save_tiny_model


def test_sharded_and_single_file_give_identical_logits(tmp_path):
    single = save_tiny_model("qwen3", tmp_path / "single", seed=3)
    sharded = save_tiny_model("qwen3", tmp_path / "sharded", seed=3, shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    batch = prompts(2048)
    a = our_logits(load_model(ModelConfig.from_path(single)), batch)
    b = our_logits(load_model(ModelConfig.from_path(sharded)), batch)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "dtype, expected",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16), ("auto", torch.float32)],
)
def test_dtype_choice(tmp_path, dtype, expected):
    folder = save_tiny_model("llama", tmp_path / "m")
    model = load_model(ModelConfig.from_path(folder, dtype=dtype))
    assert {p.dtype for p in model.parameters()} == {expected}


def test_auto_dtype_follows_the_config(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_path(folder).dtype == torch.bfloat16


def _rewrite_weights(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig.from_path(folder))


def test_mismatched_tensor_names_both_shapes(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite_weights(folder, lambda t: t.update({name: torch.zeros(64, 100)}))
    with pytest.raises(WeightLoadError) as err:
        load_model(ModelConfig.from_path(folder))
    msg = str(err.value)
    assert name in msg and "(64, 100)" in msg and "(64, 128)" in msg


def test_unexpected_tensor_is_named(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.extra\.weight"):
        load_model(ModelConfig.from_path(folder))


def test_unknown_architecture_lists_supported(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(ModelConfig.from_path(folder))
    for name in ["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]:
        assert name in str(err.value)


def test_eos_ids_may_be_a_list(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "m", eos_token_id=2)
    assert ModelConfig.from_path(folder).eos_token_ids == [2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_eos_token_ids(folder, ModelConfig.from_path(folder).hf_config) == [2, 7]


def test_not_a_model_folder(tmp_path):
    with pytest.raises(Exception, match="config.json"):
        ModelConfig.from_path(tmp_path)
