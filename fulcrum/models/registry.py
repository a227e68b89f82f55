"""Picks the model class from config.json's `architectures`."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from fulcrum.errors import UnsupportedArchitectureError
from fulcrum.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from fulcrum.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from fulcrum.models.gpt_oss import GptOssForCausalLM
from fulcrum.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from fulcrum.models.mixtral import MixtralForCausalLM
from fulcrum.models.phi3 import Phi3ForCausalLM
from fulcrum.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from fulcrum.models.vision_language import (
    REFUSED,
    Gemma3ForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # the language model of a vision-language checkpoint (fulcrum.models.vision_language)
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


def model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in REFUSED:
            raise UnsupportedArchitectureError(f"architecture {name} is not supported: {REFUSED[name]}")
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
        # a bare backbone ("Qwen3Model", as sentence-transformers saves an embedding model): its causal-LM class
        # holds the same layers under "model." (the loader maps the names; an embedding model needs no head)
        backbone = name.removesuffix("Model") + "ForCausalLM"
        if name.endswith("Model") and backbone in MODEL_REGISTRY:
            return MODEL_REGISTRY[backbone]
    raise UnsupportedArchitectureError(
        f"architecture {names or '(none given)'} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
