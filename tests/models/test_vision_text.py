"""The language model of a `...ForConditionalGeneration` checkpoint (Gemma 3, Qwen2.5-VL): loaded from the nested
text_config and the checkpoint's weight names, its logits and greedy tokens equal transformers' own class's."""

import pytest
import torch

from fulcrum.config import ModelConfig
from fulcrum.engine.llm import LLM
from fulcrum.errors import UnsupportedArchitectureError, WeightLoadError
from fulcrum.models.loader import load_model
from fulcrum.sampling_params import SamplingParams
from tests.models.test_parity import hf_logits, max_diff, our_logits, prompts
from tests.tiny_vision import IMAGE_TOKEN, VISION_FAMILIES, hf_vision_model, save_tiny_vision_model

LENS = [1, 5, 17, 40]  # Gemma 3's past its sliding window (8)


@pytest.fixture(scope="module", params=sorted(VISION_FAMILIES))
def vision_folder(request, tmp_path_factory):
    return save_tiny_vision_model(request.param, tmp_path_factory.mktemp(request.param))


def test_text_logits_equal_transformers(vision_folder):
    config = ModelConfig.from_path(vision_folder, dtype="float32")
    assert config.multimodal_config is not None and config.hf_config.hidden_size == 64
    ours = load_model(config)
    batch = prompts(IMAGE_TOKEN, lens=LENS)
    assert max_diff(our_logits(ours, batch), hf_logits(hf_vision_model(vision_folder), batch)) <= 1e-4


def test_greedy_tokens_equal_transformers_generate(vision_folder):
    prompt = prompts(IMAGE_TOKEN, seed=3, lens=[12])[0]
    llm = LLM(str(vision_folder), dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = hf_vision_model(vision_folder).generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )
    assert out[0].outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_a_missing_language_model_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_vision_model("qwen2_5-vl", tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        load_model(ModelConfig.from_path(folder, dtype="float32"))


def test_llama4_is_refused_by_name(tmp_path):
    from transformers import Llama4Config

    folder = tmp_path / "llama4"
    cfg = Llama4Config(text_config=dict(COMMON_LLAMA4), vision_config=dict(hidden_size=32, num_hidden_layers=1))
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    cfg.save_pretrained(folder)
    with pytest.raises(UnsupportedArchitectureError, match="Llama4ForConditionalGeneration.*no Llama 4 text model"):
        load_model(ModelConfig.from_path(folder, dtype="float32"))


COMMON_LLAMA4 = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
