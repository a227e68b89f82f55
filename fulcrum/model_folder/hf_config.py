"""Facts read off a Hugging Face config (a PretrainedConfig, or config.json as a namespace) without torch or
transformers, so `fulcrum plan` can use them as well as the models."""

from __future__ import annotations

import copy


def head_dim(hf_config) -> int:
    explicit = getattr(hf_config, "head_dim", None)
    return explicit or hf_config.hidden_size // hf_config.num_attention_heads


def layer_sliding_windows(hf_config) -> list[int | None]:
    """Per-layer sliding window (None = full attention), following `layer_types` when present."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * n
    return [window] * n


# `...ForConditionalGeneration` checkpoints whose language model fulcrum runs: config.json nests the text model's
# settings under `text_config`
VISION_LANGUAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# settings a vision-language config states once, at the top, that the text model's config must carry for fulcrum
TOP_LEVEL_SETTINGS = ("tie_word_embeddings", "quantization_config", "dtype", "torch_dtype")


def language_model_config(hf_config):
    """(the config fulcrum's text model is built from, the whole vision-language config or None): for a
    vision-language checkpoint its `text_config`, named by the checkpoint's architecture (so the registry picks the
    wrapper that maps its weight names) and carrying the top-level settings (a tied head, quantization, dtype)."""
    names = getattr(hf_config, "architectures", None) or []
    text = getattr(hf_config, "text_config", None)
    if text is None or not any(name in VISION_LANGUAGE_ARCHITECTURES for name in names):
        return hf_config, None
    text = copy.deepcopy(text)
    text.architectures = [next(name for name in names if name in VISION_LANGUAGE_ARCHITECTURES)]
    for key in TOP_LEVEL_SETTINGS:
        value = getattr(hf_config, key, None)
        if value is not None:
            setattr(text, key, value)
    return text, hf_config
