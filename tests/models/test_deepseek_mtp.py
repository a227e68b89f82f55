"""A DeepSeek-V3 checkpoint's multi-token-prediction layer (model.layers.<num_hidden_layers>.*, as the real V3 ships
it) is skipped at load; the same unknown tensors in another family still fail, naming the tensor."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from fulcrum.config import ModelConfig
from fulcrum.errors import WeightLoadError
from fulcrum.models.loader import load_model
from tests.tiny_models import save_tiny_model


def add_mtp_layer(folder, layer: int) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    tensors[f"model.layers.{layer}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
    tensors[f"model.layers.{layer}.enorm.weight"] = torch.ones(hidden)
    save_file(tensors, path, metadata={"format": "pt"})


def test_v3_skips_its_mtp_layer(tmp_path):
    folder = save_tiny_model("deepseek-v3", tmp_path / "v3")
    config = ModelConfig.from_path(folder, "float32")
    before = load_model(config).state_dict()
    add_mtp_layer(folder, config.hf_config.num_hidden_layers)
    after = load_model(ModelConfig.from_path(folder, "float32")).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("family", ["deepseek-v2", "llama"])
def test_other_families_still_refuse_unknown_layers(tmp_path, family):
    folder = save_tiny_model(family, tmp_path / family)
    config = ModelConfig.from_path(folder, "float32")
    add_mtp_layer(folder, config.hf_config.num_hidden_layers)
    with pytest.raises(WeightLoadError, match=r"eh_proj"):
        load_model(ModelConfig.from_path(folder, "float32"))
